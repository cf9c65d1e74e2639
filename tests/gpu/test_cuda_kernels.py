"""CUDA kernels against float64 references, through the standalone harness (no Paddle on the GPU
machine). Outputs are poisoned with NaN before each run so an unwritten element fails the test.
Tolerances: the same table as the CPU tests (tests/tolerances.py), keyed by dtype name."""

import math

import pytest
import torch

from paddle_fastffn.torch import c_api, ops

from gpu_checks import DTYPES, IDS, close


def rand(shape, dtype, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(dtype)


SWIGLU_SHAPES = [(1, 1), (1, 8), (7, 13), (3, 5, 123), (65, 11008), (2, 28672), (4097, 24)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=str)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "pair"])
def test_swiglu(shape, dtype, packed):
    k = c_api.kernels()
    if packed:
        x = rand((*shape[:-1], 2 * shape[-1]), dtype, 2.0)
        gate, up, y = x[..., : shape[-1]], x[..., shape[-1]:], None
    else:
        x, y = rand(shape, dtype, 2.0), rand(shape, dtype)
        gate, up = x, y
    out = k.swiglu_fwd(x, y)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    ref = torch.nn.functional.silu(g64) * u64
    close(out, ref, dtype, "swiglu fwd")
    d_out = rand(shape, dtype)
    ref.backward(d_out.double())
    for recompute in (False, True):
        grads, hidden = k.swiglu_bwd(x, d_out, up=y, recompute=recompute)
        d_gate, d_up = (grads[..., : shape[-1]], grads[..., shape[-1]:]) if packed else grads
        close(d_gate, g64.grad, dtype, "swiglu d_gate")
        close(d_up, u64.grad, dtype, "swiglu d_up")
        if recompute:
            close(hidden, ref.detach(), dtype, "swiglu recomputed output")


def test_swiglu_backward_in_place_matches_out_of_place():
    k = c_api.kernels()
    x = rand((33, 2 * 1000), torch.bfloat16, 2.0)
    d_out = rand((33, 1000), torch.bfloat16)
    expected, hidden = k.swiglu_bwd(x, d_out, recompute=True)
    x2, d2 = x.clone(), d_out.clone()
    got, hidden2 = k.swiglu_bwd(x2, d2, recompute=True, in_place=True)
    assert got.data_ptr() == x2.data_ptr() and hidden2.data_ptr() == d2.data_ptr()
    assert torch.equal(got, expected) and torch.equal(hidden2, hidden)


def test_swiglu_unaligned_views_take_the_scalar_path():
    k = c_api.kernels()
    base = rand((5, 2 * 64 + 1), torch.float16)
    x = base[:, 1:]  # row stride 129 elements: not 16-byte aligned
    gate, up = x[:, :64].contiguous(), x[:, 64:].contiguous()
    out = k.swiglu_fwd(gate, up)
    close(out, torch.nn.functional.silu(gate.double()) * up.double(), torch.float16, "unaligned")


# (3, 65536) and (2, 70001): fp32 partials wider than an H200's 227 KiB of shared memory per
# block, so the backward accumulates in its workspace (test_rms_norm_backward_plan_uses_the_device).
# (8192, 4096) and (20001, 36): more rows than the persistent forward grid has blocks, so each block
# walks several rows and prefetches the next (vectorised; and unvectorised for 16-bit at 36 columns).
NORM_SHAPES = [(1, 8), (7, 13), (5, 3, 127), (8192, 4096), (33, 5120), (2, 8192), (3, 20000), (3, 50000),
               (3, 65536), (2, 70001), (20001, 36)]


def _norm_reference(x64, w64, dtype, eps):
    n = x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    if dtype != torch.float32:
        n = n + (n.to(dtype).double() - n).detach()  # PaddleNLP's cast before the weight multiply
    return n * w64


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_rms_norm(shape, dtype, with_residual):
    k = c_api.kernels()
    eps = 1e-6
    x, w = rand(shape, dtype, 3.0), rand(shape[-1:], dtype)
    residual = rand(shape, dtype) if with_residual else None
    out, total, rstd = k.rms_norm_fwd(x, w, eps, residual=residual)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    src = x64
    if with_residual:
        r64 = residual.double().requires_grad_()
        src = x64 + r64
        src = src + (src.to(dtype).double() - src).detach()
        close(total, src.detach(), dtype, "x + residual")
    ref = _norm_reference(src, w64, dtype, eps)
    close(out, ref, dtype, "rms_norm fwd")
    d_out = rand(shape, dtype)
    d_sum = rand(shape, dtype) if with_residual else None
    loss = (ref * d_out.double()).sum() + ((src * d_sum.double()).sum() if with_residual else 0)
    loss.backward()
    saved = total if with_residual else x
    d_x, d_w = k.rms_norm_bwd(saved, w, rstd, d_out, eps, d_sum=d_sum)
    rows = math.prod(shape[:-1])
    close(d_x, x64.grad, dtype, "rms_norm d_x")
    if with_residual:
        close(d_x, r64.grad, dtype, "rms_norm d_residual")
    close(d_w, w64.grad, dtype, "rms_norm d_weight", reduced_rows=rows)


def test_rms_norm_backward_plan_uses_the_device():
    limits = c_api.device_limits()
    props = torch.cuda.get_device_properties(0)
    assert limits.sm_count == props.multi_processor_count
    assert limits.max_shared_bytes_per_block >= 48 * 1024
    narrow = c_api.rms_norm_bwd_plan(8192, 4096, limits)
    wide = c_api.rms_norm_bwd_plan(3, 65536, limits)
    assert narrow.shared_partials == 1 and narrow.blocks == 4 * props.multi_processor_count
    assert wide.shared_partials == 0 and wide.shared_bytes == 0 and wide.blocks == 3


def test_rotary_position_out_of_range_raises_instead_of_clamping():
    """The kernel flags an out-of-table id on the device (no host read in the forward) and
    poisons that token; the step's read of the flag raises."""
    from paddle_fastffn.core import rotary as core_rotary

    q, kk = rand((1, 4, 2, 8), torch.bfloat16), rand((1, 4, 1, 8), torch.bfloat16)
    cos = torch.ones(6, 8, device="cuda")
    sin = torch.zeros(6, 8, device="cuda")
    for bad in (6, -1):
        pos = torch.tensor([[0, 1, bad, 2]], device="cuda")
        q_out, k_out = ops.Rotary.apply(q, kk, cos, sin, pos)
        assert core_rotary.POSITION_CHECK.flag is not None  # pending, not read yet
        assert torch.isnan(q_out[0, 2]).all() and torch.isnan(k_out[0, 2]).all()
        with pytest.raises(ValueError, match=r"position_ids.*outside the cos/sin table \[0, 6\)"):
            core_rotary.POSITION_CHECK.check()
    q_out, _ = ops.Rotary.apply(q, kk, cos, sin, torch.tensor([[0, 1, 5, 2]], device="cuda"))
    core_rotary.POSITION_CHECK.check()  # valid ids: nothing flagged
    assert torch.equal(q_out, q)  # cos 1, sin 0: the identity where positions are valid


ROPE_SHAPES = [(1, 1, 1, 1, 2), (2, 7, 4, 2, 6), (3, 5, 8, 8, 64), (2, 9, 8, 2, 128), (4, 2048, 32, 8, 128)]


def _rope_tables(d, rows):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat([torch.outer(torch.arange(rows, device="cuda").float(), inv_freq)] * 2, -1)
    return emb.cos().contiguous(), emb.sin().contiguous()


def _rotate_reference(cos, sin, positions):
    """x -> x * cos[p] + rotate_half(x) * sin[p] in fp64, positions [b, s]."""
    c, sn = cos.double()[positions].unsqueeze(2), sin.double()[positions].unsqueeze(2)

    def rot(x):
        d = x.shape[-1]
        x = x.double()
        return x * c + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sn

    return rot


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
@pytest.mark.parametrize("positions", [False, True], ids=["default_positions", "position_ids"])
@pytest.mark.parametrize("fused_qkv", [False, True], ids=["separate", "qkv_views"])
def test_rotary(shape, dtype, positions, fused_qkv):
    """ops.Rotary (the core op): q and k dense or token-strided views, forward and the
    transposed rotation in backward, against fp64 autograd."""
    b, s, hq, hk, d = shape
    rows = s + 5
    cos, sin = _rope_tables(d, rows)
    if fused_qkv:
        qkv = rand((b, s, (hq + 2 * hk) * d), dtype).requires_grad_()
        q = qkv[..., : hq * d].view(b, s, hq, d)
        kk = qkv[..., hq * d: (hq + hk) * d].view(b, s, hk, d)
        leaves = [qkv]
    else:
        q, kk = rand((b, s, hq, d), dtype).requires_grad_(), rand((b, s, hk, d), dtype).requires_grad_()
        leaves = [q, kk]
    pos = torch.randint(0, rows, (b, s), device="cuda") if positions else None
    q_out, k_out = ops.Rotary.apply(q, kk, cos, sin, pos)
    rot = _rotate_reference(cos, sin, pos if positions else torch.arange(s, device="cuda").expand(b, s))
    close(q_out, rot(q.detach()), dtype, "rope q")
    close(k_out, rot(kk.detach()), dtype, "rope k")
    # Backward = transpose: <R q, u> == <q, R^T u> checked elementwise against autograd.
    q64, k64 = q.detach().double().requires_grad_(), kk.detach().double().requires_grad_()
    u_q, u_k = rand(q_out.shape, dtype), rand(k_out.shape, dtype)
    ((rot(q64) * u_q.double()).sum() + (rot(k64) * u_k.double()).sum()).backward()
    grads = torch.autograd.grad((q_out, k_out), leaves, (u_q, u_k))
    if fused_qkv:
        d_q = grads[0][..., : hq * d].view(b, s, hq, d)
        d_k = grads[0][..., hq * d: (hq + hk) * d].view(b, s, hk, d)
    else:
        d_q, d_k = grads
    close(d_q, q64.grad, dtype, "rope d_q")
    close(d_k, k64.grad, dtype, "rope d_k")
    _check_pending_positions()


def _check_pending_positions():
    """Reads the step's pending position flag (positions in these tests are all in the table)."""
    from paddle_fastffn.core import rotary as core_rotary

    core_rotary.POSITION_CHECK.check()


@pytest.mark.parametrize("split_gemms", [False, True], ids=["fused_gemm", "split_gemm"])
def test_fused_ffn_matches_eager_in_fp32(split_gemms):
    torch.backends.cuda.matmul.allow_tf32 = False
    x = rand((2, 17, 64), torch.float32).requires_grad_()
    w_gu = (rand((2 * 96, 64), torch.float32) * 0.1).requires_grad_()
    w_d = (rand((64, 96), torch.float32) * 0.1).requires_grad_()
    d_y = rand((2, 17, 64), torch.float32)
    for recompute in (False, True):
        y = ops.fused_ffn(x, w_gu, w_d, recompute, split_gemms)
        grads = torch.autograd.grad(y, [x, w_gu, w_d], d_y)
        g, u = (x @ w_gu.t()).chunk(2, -1)
        ref = (torch.nn.functional.silu(g) * u) @ w_d.t()
        ref_grads = torch.autograd.grad(ref, [x, w_gu, w_d], d_y)
        close(y, ref, torch.float32, "ffn out")
        for got, want, name in zip(grads, ref_grads, ["d_x", "d_w_gate_up", "d_w_down"]):
            close(got, want, torch.float32, f"ffn {name} (recompute={recompute})", reduced_rows=34)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "stored"])
def test_swiglu_down_proj_matches_eager_in_fp32(recompute):
    torch.backends.cuda.matmul.allow_tf32 = False
    gate_up = rand((2, 17, 2 * 96), torch.float32).requires_grad_()
    w_d = (rand((64, 96), torch.float32) * 0.1).requires_grad_()
    d_y = rand((2, 17, 64), torch.float32)
    ref_in = gate_up.detach().clone().requires_grad_()
    g, u = ref_in.chunk(2, -1)
    ref = (torch.nn.functional.silu(g) * u) @ w_d.t()
    ref_grads = torch.autograd.grad(ref, [ref_in, w_d], d_y)
    y = ops.SwiGLUDownProj.apply(gate_up * 1.0, w_d, recompute)  # * 1.0: a private intermediate
    grads = torch.autograd.grad(y, [gate_up, w_d], d_y)
    close(y, ref, torch.float32, "swiglu_down_proj out")
    close(grads[0], ref_grads[0], torch.float32, "d_gate_up")
    close(grads[1], ref_grads[1], torch.float32, "d_w_down", reduced_rows=34)


def fp32_hf_decoder_layer():
    """A Hugging Face LlamaDecoderLayer in fp32 (GQA 4/2 heads, hidden 256, intermediate 688) with
    random weights and norms, TF32 off."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                      num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    hf = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to("cuda", torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return config, hf


def hf_and_fast_outputs(config, hf, fast):
    """(x, Hugging Face's output, ours) on the same random input [2, 33, 256] with rope tables from
    Hugging Face's rotary embedding."""
    from transformers.models.llama import modeling_llama

    rope = modeling_llama.LlamaRotaryEmbedding(config=config).to("cuda")
    x = rand((2, 33, 256), torch.float32).requires_grad_()
    position_ids = torch.arange(33, device="cuda").expand(2, 33)
    cos, sin = rope(x, position_ids)
    out = hf(x, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))
    ref = out[0] if isinstance(out, tuple) else out
    return x, ref, fast(x, cos[0].float().contiguous(), sin[0].float().contiguous())


def test_benchmarked_decoder_layer_matches_hugging_face_in_fp32():
    """The decoder layer the benchmark times (the shared composition, step by step) computes what
    Hugging Face's LlamaDecoderLayer computes, forward and every gradient."""
    from paddle_fastffn.torch.llama import FastDecoderLayer

    config, hf = fp32_hf_decoder_layer()
    fast = FastDecoderLayer(hf, 4, 2, config.rms_norm_eps).to("cuda")
    x, ref, got = hf_and_fast_outputs(config, hf, fast)
    d_y = rand(ref.shape, torch.float32)
    ref_grads = torch.autograd.grad(ref, [x, hf.self_attn.q_proj.weight, hf.mlp.down_proj.weight], d_y)
    grads = torch.autograd.grad(got, [x, fast.w_qkv, fast.w_down], d_y)
    # fp32 throughout: only summation order differs (SDPA backends, fused vs separate GEMMs). The
    # layer chains about ten reductions, the longest over K = 688 terms (the down GEMM), and
    # fp32 summation-order error grows like sqrt(K): the absolute tolerance scales with it.
    for got_t, want, name in ((got, ref, "out"), (grads[0], ref_grads[0], "d_x"),
                              (ops.split_qkv_weight(grads[1], 4, 2)[0], ref_grads[1], "d_w_q"),
                              (grads[2], ref_grads[2], "d_w_down")):
        close(got_t, want, torch.float32, f"decoder layer {name}", reduced_rows=688)


def test_benchmarked_lora_decoder_layer_matches_merged_hugging_face_in_fp32():
    """The LoRA layer the full-depth benchmark times (LLAMA_DECODER_LAYER_UNFUSED: unfused
    projections, each W x + scaling * B A x over a frozen W, two-input SwiGLU) computes Hugging
    Face's LlamaDecoderLayer with the adapters merged into its weights (W + scaling * B A), an
    independent reference: the output and d_x equal, and each adapter's gradients are the merged
    weight's gradient through the merge, dA = scaling * B^T dW, dB = scaling * dW A^T."""
    import copy

    from paddle_fastffn.torch.llama import COMPOSITION, UNFUSED_PROJECTIONS, FastDecoderLayer, LoraSettings

    config, hf = fp32_hf_decoder_layer()
    lora = LoraSettings(rank=4, alpha=8)
    fast = FastDecoderLayer(hf, 4, 2, config.rms_norm_eps, lora=lora).to("cuda")
    assert fast.steps == COMPOSITION.LLAMA_DECODER_LAYER_UNFUSED
    assert not any(p.requires_grad for n, p in fast.named_parameters() if not n.startswith("lora_"))
    merged = copy.deepcopy(hf)
    with torch.no_grad():
        for name, _, path in UNFUSED_PROJECTIONS:
            fast.lora_b[name].normal_(0, 0.05)  # B starts at zero: give the adapters something to add
            merged.get_submodule(path).weight += lora.scaling * fast.lora_b[name] @ fast.lora_a[name]
    x, ref, got = hf_and_fast_outputs(config, merged, fast)
    d_y = rand(ref.shape, torch.float32)
    merged_weights = [merged.get_submodule(path).weight for _, _, path in UNFUSED_PROJECTIONS]
    ref_grads = torch.autograd.grad(ref, [x] + merged_weights, d_y)
    adapters = [t for name, _, _ in UNFUSED_PROJECTIONS for t in (fast.lora_a[name], fast.lora_b[name])]
    grads = torch.autograd.grad(got, [x] + adapters, d_y)
    close(got, ref, torch.float32, "lora decoder layer out", reduced_rows=688)
    close(grads[0], ref_grads[0], torch.float32, "lora decoder layer d_x", reduced_rows=688)
    for i, (name, _, _) in enumerate(UNFUSED_PROJECTIONS):
        d_w = ref_grads[1 + i]
        a, b = fast.lora_a[name].detach(), fast.lora_b[name].detach()
        close(grads[1 + 2 * i], lora.scaling * b.t() @ d_w, torch.float32, f"d_lora_A {name}", reduced_rows=688)
        close(grads[2 + 2 * i], lora.scaling * d_w @ a.t(), torch.float32, f"d_lora_B {name}", reduced_rows=688)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (6, 2)], ids=["mha", "gqa4", "gqa3"])
@pytest.mark.parametrize("positions", [False, True], ids=["default_positions", "position_ids"])
def test_qkv_rotary_reads_and_writes_the_interleaved_fused_qkv(dtype, heads, positions):
    """ops.qkv_rotary on PaddleNLP's interleaved fused qkv ([b, s, kv_heads, (G + 2) d]: per KV
    group its G query heads, its k head, its v head): rotated q, k and a copy of v against the
    reshape + split + rotate reference, and the one d_qkv buffer (every slot written: outputs
    start as NaN under POISON_OUTPUTS) against fp64 autograd through the same reference."""
    hq, hk = heads
    groups = hq // hk
    b, s, d = 2, 33, 64
    qkv = rand((b, s, (hq + 2 * hk) * d), dtype).requires_grad_()
    cos, sin = _rope_tables(d, s + 7)
    pos = torch.randint(0, s + 7, (b, s), device="cuda") if positions else None
    q, k, v = ops.qkv_rotary(qkv, hq, hk, cos, sin, pos)
    u = [rand(t.shape, dtype) for t in (q, k, v)]
    (d_qkv,) = torch.autograd.grad((q, k, v), [qkv], u)
    ref_in = qkv.detach().double().requires_grad_()
    rq, rk, rv = ref_in.view(b, s, hk, (groups + 2) * d).split([groups * d, d, d], -1)
    rot = _rotate_reference(cos, sin, pos if positions else torch.arange(s, device="cuda").expand(b, s))
    outs = (rot(rq.reshape(b, s, hq, d)), rot(rk), rv)
    for got, want, name in zip((q, k, v), outs, "qkv"):
        assert got.is_contiguous() and got.shape == want.shape, name
        close(got, want, dtype, f"qkv-rotary {name}")
    (ref_grad,) = torch.autograd.grad(outs, [ref_in], [t.double() for t in u])
    close(d_qkv, ref_grad, dtype, "d_qkv")
    _check_pending_positions()


def test_fused_qkv_weight_is_paddlenlp_interleaved_layout():
    """fuse_qkv_weight orders rows per KV group as PaddleNLP's fuse_param_func(is_qkv=True) does
    ([q1, q2, k1, v1, q3, q4, k2, v2] for 4 heads, 2 KV heads), and split_qkv_weight undoes it."""
    d = 3
    q_w, k_w, v_w = (torch.arange(n * d, dtype=torch.float32).repeat_interleave(2).view(n * d, 2) + base
                     for n, base in ((4, 0), (2, 100), (2, 200)))
    fused = ops.fuse_qkv_weight(q_w, k_w, v_w, 4, 2)
    blocks = [q_w[0:6], k_w[0:3], v_w[0:3], q_w[6:12], k_w[3:6], v_w[3:6]]
    assert torch.equal(fused, torch.cat(blocks))
    for got, want in zip(ops.split_qkv_weight(fused, 4, 2), (q_w, k_w, v_w)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "lora"])
def test_benchmarked_decoder_layer_executes_the_core_steps(kind, monkeypatch):
    """FastDecoderLayer runs core.decoder over its parts: recording each part it calls (by the step
    core/decoder.py names it) gives the list the Paddle patch is traced against on CPU
    (tests/integration/test_composition.py): the fast path's default, FP8 and LoRA layers."""
    from paddle_fastffn.core.decoder import STEP_OF_PART
    from paddle_fastffn.torch.fp8.ffn import Fp8Recipe
    from paddle_fastffn.torch.llama import COMPOSITION, FastDecoderLayer, LoraSettings, rope_tables

    config, hf = fp32_hf_decoder_layer()
    hf = hf.to(torch.bfloat16)
    options = {"bf16": {}, "fp8": {"fp8_recipe": Fp8Recipe("current")}, "lora": {"lora": LoraSettings(rank=4)}}
    fast = FastDecoderLayer(hf, 4, 2, config.rms_norm_eps, **options[kind]).to("cuda")
    expected = {"bf16": COMPOSITION.LLAMA_DECODER_LAYER, "fp8": COMPOSITION.LLAMA_DECODER_LAYER_FP8,
                "lora": COMPOSITION.LLAMA_DECODER_LAYER_UNFUSED}[kind]
    steps = []

    def recording(step, part):
        def call(*args):
            steps.append(step)
            return part(*args)
        return call
    for part, step in STEP_OF_PART.items():
        monkeypatch.setattr(fast, part, recording(step, getattr(fast, part)))
    x = rand((2, 32, 256), torch.bfloat16).requires_grad_()
    cos, sin = rope_tables(config, 32)
    out = fast(x, cos, sin)
    out.backward(torch.ones_like(out))
    assert tuple(steps) == expected == fast.steps, steps
    assert torch.isfinite(x.grad).all()
