"""The AdamW kernel (fastffn_adamw_cuda, fastffn/optimizer.h) against a float64 torch reference of
Paddle's formula, and FusedMasterAdamW (paddle_fastffn/torch/llama.py) against MasterWeightAdamW
and, with the global-norm clip, against torch's AdamW fed Paddle's clip coefficient, through the
ctypes harness.

Each step is checked from the kernel's own state (so every step is a one-step comparison):
masters and moments within the fp32 row of the tolerance table (fp32 math against float64), the
parameter within its dtype's row (a 16-bit parameter is the fp32 value rounded once; where that
value straddles a rounding boundary it lands one ulp from the rounded float64 value: 2^-7
relative for bf16, inside the row), and a parameter with a master equal to the master rounded.
The kernel updates its tensors in place, so the poison is around them: every tensor is a view
into a NaN-filled buffer with guard elements on both sides, which must still be NaN afterwards."""

import ctypes
import math

import pytest
import torch

from paddle_fastffn.torch import c_api

from gpu_checks import DTYPES, IDS, close

GUARD = 37
SIZES = [1, 3, 7, 8, 4097, 65537, (1 << 20) + 5]


def f32(v: float) -> float:
    """A hyper-parameter as the kernel receives it (fp32)."""
    return float(torch.tensor(v, dtype=torch.float32))


def pows(beta1, beta2, step):
    """Paddle's beta powers at `step` (from 1): beta, then multiplied by beta in fp32 each step."""
    b1, b2 = torch.tensor(beta1), torch.tensor(beta2)
    p1, p2 = b1.clone(), b2.clone()
    for _ in range(step - 1):
        p1, p2 = p1 * b1, p2 * b2
    return float(p1), float(p2)


def paddle_adamw_ref(p, g, m1, m2, *, lr, beta1_pow, beta2_pow, beta1, beta2, eps, weight_decay,
                     lr_ratio=1.0, with_decay=True, grad_scale=1.0):
    """Paddle's CUDA adamw update (AdamWKernelREG) in float64; returns (p, m1, m2)."""
    beta1, beta2, eps = f32(beta1), f32(beta2), f32(eps)
    lr = f32(lr) * f32(lr_ratio)
    g = g.double() * f32(grad_scale)
    p = p.double() * (1.0 - lr * (f32(weight_decay) if with_decay else 0.0))
    m1 = beta1 * m1.double() + (1.0 - beta1) * g
    m2 = beta2 * m2.double() + (1.0 - beta2) * g * g
    denom = m2.sqrt() / math.sqrt(1.0 - beta2_pow) + eps
    return p + (m1 / denom) * (-(lr / (1.0 - beta1_pow))), m1, m2


def guarded(values, dtype, offset=0):
    """`values` in a view of a NaN buffer: `offset` elements plus GUARD before, GUARD after."""
    n = values.numel()
    buf = torch.full((GUARD + offset + n + GUARD,), float("nan"), dtype=dtype, device="cuda")
    view = buf[GUARD + offset: GUARD + offset + n]
    view.copy_(values.to(dtype))
    return buf, view


def assert_guards_untouched(buf, n, offset, what):
    outside = torch.cat([buf[: GUARD + offset], buf[GUARD + offset + n:]])
    assert torch.isnan(outside.float()).all(), f"{what}: the kernel wrote outside its {n} elements"


HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def run_and_check(n, dtype, with_master, fp32_grad, offsets=(0, 0, 0, 0, 0), steps=3, lr=1e-2,
                  device_scalars=True):
    """`steps` kernel steps, each compared with the reference from the kernel's state before it."""
    k = c_api.kernels()
    o_param, o_grad, o_master, o_m1, o_m2 = offsets
    init = torch.randn(n, device="cuda")
    param_buf, param = guarded(init, dtype, o_param)
    master_buf, master = guarded(param.float(), torch.float32, o_master) if with_master else (None, None)
    m1_buf, m1 = guarded(torch.zeros(n, device="cuda"), torch.float32, o_m1)
    m2_buf, m2 = guarded(torch.zeros(n, device="cuda"), torch.float32, o_m2)
    lr_t = torch.tensor([lr], device="cuda")
    for step in range(1, steps + 1):
        grad_buf, grad = guarded(torch.randn(n, device="cuda") * 10 ** (step - 2),
                                 torch.float32 if fp32_grad else dtype, o_grad)
        b1p, b2p = pows(HYPER["beta1"], HYPER["beta2"], step)
        start = master if with_master else param
        ref_p, ref_m1, ref_m2 = paddle_adamw_ref(start, grad, m1, m2, lr=lr, beta1_pow=b1p,
                                                 beta2_pow=b2p, **HYPER)
        scalars = (dict(lr=lr_t, beta1_pow=torch.tensor([b1p], device="cuda"),
                        beta2_pow=torch.tensor([b2p], device="cuda")) if device_scalars
                   else dict(lr=lr, beta1_pow=b1p, beta2_pow=b2p))
        k.adamw(param, grad, m1, m2, master, **scalars, **HYPER)
        what = f"adamw n={n} {dtype} step {step}"
        close(m1, ref_m1, torch.float32, f"{what} moment1")
        close(m2, ref_m2, torch.float32, f"{what} moment2")
        close(param, ref_p, dtype, f"{what} param")
        if with_master:
            close(master, ref_p, torch.float32, f"{what} master")
            assert torch.equal(param, master.to(dtype)), f"{what}: param != master rounded"
        assert_guards_untouched(grad_buf, n, o_grad, f"{what} grad")
    for buf, offset, name in ((param_buf, o_param, "param"), (master_buf, o_master, "master"),
                              (m1_buf, o_m1, "moment1"), (m2_buf, o_m2, "moment2")):
        if buf is not None:
            assert_guards_untouched(buf, n, offset, f"n={n} {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n", SIZES, ids=str)
@pytest.mark.parametrize("with_master", [True, False], ids=["master", "no_master"])
def test_adamw_matches_paddles_formula(n, dtype, with_master):
    run_and_check(n, dtype, with_master, fp32_grad=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_adamw_fp32_gradients_of_16bit_parameters(dtype):
    run_and_check(4097, dtype, True, fp32_grad=True)


@pytest.mark.parametrize("offsets", [(1, 1, 1, 1, 1), (0, 1, 0, 0, 0), (0, 0, 0, 0, 3)],
                         ids=["all_offset", "grad_offset", "moment2_offset"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_adamw_misaligned_views_take_the_scalar_path(offsets, dtype):
    run_and_check(4099, dtype, True, fp32_grad=False, offsets=offsets)


def test_adamw_host_scalars_are_the_device_scalars_bit_for_bit():
    run_and_check(1000, torch.bfloat16, True, False, device_scalars=False)
    results = []
    k = c_api.kernels()
    for device_scalars in (True, False):
        p = torch.linspace(-2, 2, 999, device="cuda")
        g, m1, m2 = torch.sin(p * 7), torch.zeros_like(p), torch.zeros_like(p)
        lr, b1p, b2p = 0.01, 0.9, 0.95
        if device_scalars:
            lr, b1p, b2p = (torch.tensor([v], device="cuda") for v in (lr, b1p, b2p))
        k.adamw(p, g, m1, m2, lr=lr, beta1_pow=b1p, beta2_pow=b2p, **HYPER)
        results.append((p, m1, m2))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_adamw_nan_and_inf_gradients_propagate():
    k = c_api.kernels()
    n = 4097
    p = torch.randn(n, device="cuda").to(torch.bfloat16)
    master = p.float()
    g = torch.randn(n, device="cuda").to(torch.bfloat16)
    g[[5, 4096]] = float("nan")
    g[77] = float("inf")
    m1, m2 = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    k.adamw(p, g, m1, m2, master, lr=0.01, beta1_pow=0.9, beta2_pow=0.95, **HYPER)
    bad = torch.zeros(n, dtype=torch.bool, device="cuda")
    bad[[5, 77, 4096]] = True
    assert torch.isnan(master[bad]).all() and torch.isnan(p[bad].float()).all()
    assert torch.isfinite(master[~bad]).all()
    assert torch.isinf(m2[77]) and torch.isnan(m1[5])


def test_adamw_clip_coefficient_and_lr_ratio_without_decay():
    k = c_api.kernels()
    n = 333
    p, g = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    m1, m2 = torch.rand(n, device="cuda") * 0.1, torch.rand(n, device="cuda") * 0.01
    scale = torch.tensor([0.3], device="cuda")
    ref = paddle_adamw_ref(p, g, m1, m2, lr=0.02, beta1_pow=0.5, beta2_pow=0.7, lr_ratio=0.25,
                           with_decay=False, grad_scale=0.3, **HYPER)
    k.adamw(p, g, m1, m2, lr=0.02, beta1_pow=0.5, beta2_pow=0.7, lr_ratio=0.25, with_decay=False,
            grad_scale=scale, **HYPER)
    for got, want, name in zip((p, m1, m2), ref, ("param", "moment1", "moment2")):
        close(got, want, torch.float32, f"clipped {name}")


def test_adamw_in_a_cuda_graph_reads_the_current_scalars():
    """Captured once, replayed with a new learning rate, beta powers and clip coefficient: the same
    bits as an eager call with those values."""
    k = c_api.kernels()
    n = 70001
    torch.manual_seed(2)
    p = torch.randn(n, device="cuda").to(torch.bfloat16)
    master, g = p.float(), torch.randn(n, device="cuda").to(torch.bfloat16)
    m1, m2 = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    lr, b1p, b2p, scale = (torch.tensor([v], device="cuda") for v in (0.0, 0.9, 0.95, 1.0))
    eager = [t.clone() for t in (p, master, m1, m2)]

    def step(tensors):
        k.adamw(tensors[0], g, tensors[2], tensors[3], tensors[1], lr=lr, beta1_pow=b1p,
                beta2_pow=b2p, grad_scale=scale, **HYPER)
        k.adamw_update_pows(HYPER["beta1"], HYPER["beta2"], b1p, b2p)

    step([t.clone() for t in (p, master, m1, m2)])  # loads the kernels before the capture
    b1p.fill_(0.9)
    b2p.fill_(0.95)
    graph_state = [p, master, m1, m2]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        step(graph_state)
    torch.cuda.current_stream().wait_stream(side)
    lr.fill_(0.05)
    scale.fill_(0.5)
    graph.replay()
    graph.replay()
    lr2, b1, b2, s2 = (torch.tensor([v], device="cuda") for v in (0.05, 0.9, 0.95, 0.5))
    for pow1, pow2 in (pows(0.9, 0.95, 1), pows(0.9, 0.95, 2)):
        b1.fill_(pow1)
        b2.fill_(pow2)
        k.adamw(eager[0], g, eager[2], eager[3], eager[1], lr=lr2, beta1_pow=b1, beta2_pow=b2,
                grad_scale=s2, **HYPER)
    torch.cuda.synchronize()
    for got, want in zip(graph_state, eager):
        assert torch.equal(got, want)
    assert b1p.item() == pows(0.9, 0.95, 3)[0] and b2p.item() == pows(0.9, 0.95, 3)[1]


def test_adamw_update_pows_multiplies_in_fp32():
    k = c_api.kernels()
    b1p, b2p = torch.tensor([0.9], device="cuda"), torch.tensor([0.999], device="cuda")
    for step in range(2, 6):
        k.adamw_update_pows(0.9, 0.999, b1p, b2p)
        assert (b1p.item(), b2p.item()) == pows(0.9, 0.999, step)


def test_adamw_statuses():
    k = c_api.kernels()
    x = torch.zeros(8, device="cuda", dtype=torch.float64)
    m = torch.zeros(8, device="cuda")
    # The harness's _check passes on the C layer's own message (fastffn_last_error).
    with pytest.raises(RuntimeError, match=r"adamw: unsupported dtype: fastffn_adamw_cuda: param_dtype "
                                           r"is FLOAT64 \(3\); this kernel stores FLOAT32, FLOAT16, BFLOAT16$"):
        k.adamw(x, x, m, m, lr=0.1, beta1_pow=0.9, beta2_pow=0.9)
    with pytest.raises(RuntimeError, match=r"adamw: unsupported dtype: fastffn_adamw_cuda: grad_dtype is "
                                           r"BFLOAT16; it must be the param's dtype \(FLOAT16\) or FLOAT32"):
        k.adamw(m.half(), m.bfloat16(), m, m, lr=0.1, beta1_pow=0.9, beta2_pow=0.9)
    args = c_api.AdamwArgs(8, 0, 0, 0.9, 0.999, 1e-8, 0.0, 1.0, 1, c_api.scalar(0.1),
                             c_api.scalar(0.9), c_api.scalar(0.9), c_api.scalar(1.0))
    status = k.lib.fastffn_adamw_cuda(args, m.data_ptr(), None, None, m.data_ptr(), m.data_ptr(),
                                      ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert status == 1  # INVALID_ARGUMENT: no gradient
    args.n = -1
    assert k.lib.fastffn_adamw_cuda(args, m.data_ptr(), m.data_ptr(), None, m.data_ptr(),
                                    m.data_ptr(), None) == 1


def test_fused_master_adamw_matches_master_weight_adamw():
    """The same steps as MasterWeightAdamW (torch's fused AdamW on fp32 masters): masters and
    moments within the fp32 row (the same math in another order), parameters = masters rounded."""
    from paddle_fastffn.torch.llama import FusedMasterAdamW, MasterWeightAdamW

    torch.manual_seed(3)
    shapes = [(64, 48), (4097,), (48,)]
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32]
    init = [torch.randn(s, device="cuda").to(d) for s, d in zip(shapes, dtypes)]
    ours_p = [t.clone().requires_grad_() for t in init]
    ref_p = [t.clone().requires_grad_() for t in init]
    ours = FusedMasterAdamW(ours_p, lr=1e-2)
    ref = MasterWeightAdamW(ref_p, lr=1e-2)
    for _ in range(4):
        for a, b in zip(ours_p, ref_p):
            g = torch.randn(a.shape, device="cuda").to(a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
    for i, (a, b) in enumerate(zip(ours_p, ref_p)):
        master = ours.masters[i] if ours.masters[i] is not None else a.detach()
        close(master, ref.masters[i], torch.float32, f"master {i}")
        state = ref.optimizer.state[ref.masters[i]]
        close(ours.m[i], state["exp_avg"], torch.float32, f"moment1 {i}")
        close(ours.v[i], state["exp_avg_sq"], torch.float32, f"moment2 {i}")
        assert torch.equal(a.detach(), master.to(a.dtype))
    assert all(p.grad is None for p in ours_p)


def paddle_clip_coefficient(grads, clip_norm):
    """ClipGradByGlobalNorm's coefficient as Paddle computes it on a GPU, in float64: each squared
    norm rounded to its gradient's dtype (squared_l2_norm's result), then summed."""
    squares = [(g.double() ** 2).sum().to(g.dtype).double() for g in grads]
    norm = torch.stack(squares).sum().sqrt()
    return clip_norm / max(norm.item(), clip_norm)


def test_fused_master_adamw_clips_the_global_norm_as_paddle():
    """max_grad_norm: every gradient multiplied by Paddle's coefficient (its squared norms in the
    gradients' dtype, paddle_clip_coefficient) before torch's AdamW on fp32 masters: masters and
    moments within the fp32 row. The clip is on (the gradients' norm is far above 0.5)."""
    from paddle_fastffn.torch.llama import FusedMasterAdamW

    torch.manual_seed(3)
    shapes = [(64, 48), (4097,), (48,)]
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32]
    init = [torch.randn(s, device="cuda").to(d) for s, d in zip(shapes, dtypes)]
    ours_p = [t.clone().requires_grad_() for t in init]
    ref_masters = [t.float().clone().requires_grad_() for t in init]
    ours = FusedMasterAdamW(ours_p, lr=1e-2, max_grad_norm=0.5)
    ref = torch.optim.AdamW(ref_masters, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, foreach=False)
    for _ in range(4):
        grads = [torch.randn(a.shape, device="cuda").to(a.dtype) for a in ours_p]
        coefficient = paddle_clip_coefficient(grads, 0.5)
        assert coefficient < 0.1
        for a, r, g in zip(ours_p, ref_masters, grads):
            a.grad, r.grad = g.clone(), g.float() * coefficient
        ours.step()
        ref.step()
        ours.zero_grad()
    for i, (a, r) in enumerate(zip(ours_p, ref_masters)):
        master = ours.masters[i] if ours.masters[i] is not None else a.detach()
        close(master, r.detach(), torch.float32, f"master {i}")
        close(ours.m[i], ref.state[r]["exp_avg"], torch.float32, f"moment1 {i}")
        close(ours.v[i], ref.state[r]["exp_avg_sq"], torch.float32, f"moment2 {i}")
        assert torch.equal(a.detach(), master.to(a.dtype))


def test_fused_master_adamw_parameter_that_misses_a_step():
    """A parameter without a gradient is skipped and its own beta powers (on the host, as Paddle
    keeps them) lag behind the others', as in Paddle and in torch's AdamW, which is the reference
    here (fp32 parameters; MasterWeightAdamW would step a stale fp32 gradient buffer instead)."""
    from paddle_fastffn.torch.llama import FusedMasterAdamW

    torch.manual_seed(4)
    init = [torch.randn(s, device="cuda") for s in ((33,), (65,))]
    ours_p = [t.clone().requires_grad_() for t in init]
    ref_p = [t.clone().requires_grad_() for t in init]
    ours = FusedMasterAdamW(ours_p, lr=1e-2)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, foreach=False)
    for step in range(4):
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            a.grad = b.grad = None
            if not (step == 1 and i == 1):
                g = torch.randn(a.shape, device="cuda")
                a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for i, (a, b) in enumerate(zip(ours_p, ref_p)):
        close(a.detach(), b.detach(), torch.float32, f"param {i}")
    for (beta1_pow, beta2_pow), steps in zip(ours.beta_pows, (4, 3)):
        assert not beta1_pow.is_cuda and (beta1_pow.item(), beta2_pow.item()) == pows(0.9, 0.95, steps + 1)


def test_fused_master_adamw_runs_one_kernel_per_parameter_and_writes_the_lr_only_when_it_changes():
    """The optimizer step of the trace (tests/traces/training_step.json): one adamw launch per
    parameter with a gradient and no beta-power kernel; set_lr fills the device scalar only when the
    value changes."""
    from paddle_fastffn.torch.llama import FusedMasterAdamW

    params = [torch.randn(s, device="cuda").requires_grad_() for s in ((33,), (65,))]
    ours = FusedMasterAdamW(params, lr=1e-2)
    calls = []
    k = c_api.kernels()
    for name in ("adamw", "adamw_update_pows"):
        original = getattr(k, name)
        setattr(k, name, lambda *a, _name=name, _f=original, **kw: (calls.append(_name), _f(*a, **kw))[1])
    try:
        for p in params:
            p.grad = torch.randn_like(p)
        ours.step()
    finally:
        del k.adamw, k.adamw_update_pows
    assert calls == ["adamw", "adamw"]
    fills = []
    fill = ours._backend.fill_
    ours._backend.fill_ = lambda t, value: (fills.append(value), fill(t, value))
    ours.set_lr(1e-2)  # unchanged: nothing runs
    ours.set_lr(5e-3)
    ours.set_lr(5e-3)
    assert fills == [5e-3]
    assert ours.lr.item() == torch.tensor(5e-3).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_low_memory_state_matches_the_numpy_reference_on_the_gpu(dtype):
    """fastffn_adamw_with_state_cuda (8-bit blockwise moments, Kahan compensation) through
    FusedMasterAdamW, against tests/adamw_low_memory_ref.py: the CPU check of
    tests/torch_cpu/test_low_memory_adamw_cpu.py, on the GPU's kernel."""
    from tests.torch_cpu.test_low_memory_adamw_cpu import check_against_reference

    check_against_reference(dtype, "cuda")


def lead(dtype, aligned):
    """The offset that puts a guarded view of `dtype` on a 16-byte boundary, or one element past it."""
    per_vector = 16 // torch.empty((), dtype=dtype).element_size()
    return -GUARD % per_vector + (0 if aligned else 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_blockwise_state_aligned_and_misaligned_paths_agree_bit_for_bit(dtype):
    """fastffn_adamw_with_state_cuda with 8-bit moments (and compensation for bf16) over (1 << 20) + 77
    elements: several quantisation blocks per warp of the persistent grid and a partial last block.
    Aligned tensors (16-byte vectors a lane) and the same state in views one element off a 16-byte
    boundary (the element-wise path) give the same bits after three steps, and neither writes
    outside its views."""
    k = c_api.kernels()
    n = (1 << 20) + 77
    blocks = -(-n // 256)
    torch.manual_seed(0)
    init = torch.randn(n, device="cuda")
    grads = [torch.randn(n, device="cuda") * 10.0 ** (step - 2) for step in range(3)]
    names = ("param", "compensation", "codes1", "codes2", "absmax1", "absmax2")
    states = []
    for aligned in (True, False):
        offset, code_offset = lead(dtype, aligned), lead(torch.uint8, aligned)

        def codes_view(fill):
            buf = torch.full((GUARD + code_offset + n + GUARD,), 0xAB, dtype=torch.uint8, device="cuda")
            buf[GUARD + code_offset: GUARD + code_offset + n] = fill
            return buf, buf[GUARD + code_offset: GUARD + code_offset + n]

        param_buf, param = guarded(init, dtype, offset)
        comp_buf, comp = guarded(torch.zeros(n, device="cuda"), dtype, offset) if dtype != torch.float32 else (None, None)
        codes1_buf, codes1 = codes_view(127)  # the signed map's 0.0
        codes2_buf, codes2 = codes_view(0)
        absmax_buf = torch.full((2, blocks + 2), float("nan"), device="cuda")
        absmax1, absmax2 = absmax_buf[0, 1:-1], absmax_buf[1, 1:-1]
        absmax1.zero_()
        absmax2.zero_()
        what = f"{dtype} {'aligned' if aligned else 'misaligned'}"
        for step, g in enumerate(grads, start=1):
            grad_buf, grad = guarded(g, dtype, offset)
            b1p, b2p = pows(HYPER["beta1"], HYPER["beta2"], step)
            k.adamw_with_state(param, grad, codes1, codes2, None, comp, absmax1, absmax2, lr=1e-2, beta1_pow=b1p,
                               beta2_pow=b2p, **HYPER)
            assert_guards_untouched(grad_buf, n, offset, f"{what} grad")
        assert_guards_untouched(param_buf, n, offset, f"{what} param")
        if comp_buf is not None:
            assert_guards_untouched(comp_buf, n, offset, f"{what} compensation")
        for buf in (codes1_buf, codes2_buf):
            outside = torch.cat([buf[: GUARD + code_offset], buf[GUARD + code_offset + n:]])
            assert (outside == 0xAB).all(), f"{what}: the kernel wrote outside its codes"
        assert torch.isnan(absmax_buf[:, [0, -1]]).all(), f"{what}: the kernel wrote outside its absmax"
        assert (absmax1 > 0).all() and (absmax2 > 0).all(), what
        states.append(dict(zip(names, (param, comp, codes1, codes2, absmax1, absmax2))))
    for name in names:
        if states[0][name] is not None:
            assert torch.equal(states[0][name], states[1][name]), f"{dtype} {name}: the two paths differ"


@pytest.mark.parametrize("layout", ["fp32_master", "int8_master", "compensated", "fp32_param"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_param_amax_is_the_stored_parameters_max_on_the_gpu(layout, aligned):
    """fastffn_adamw_with_state_cuda's param_amax over (1 << 20) + 77 elements (many thread blocks,
    a partial tail): bit for bit max |param| of what the kernel stored, in every layout, on the
    vector and the element-wise paths; written (the 1e9 it held goes), and NaN once a NaN is stored."""
    k = c_api.kernels()
    n = (1 << 20) + 77
    torch.manual_seed(0)
    dtype = torch.float32 if layout == "fp32_param" else torch.bfloat16
    offset = lead(dtype, aligned)
    param_buf, param = guarded(torch.randn(n, device="cuda") * 3, dtype, offset)
    master = param.float().clone() if layout.endswith("master") else None
    compensation = torch.zeros_like(param) if layout == "compensated" else None
    if layout.startswith("int8"):
        blocks = -(-n // 256)
        m1, m2 = torch.full((n,), 127, dtype=torch.uint8, device="cuda"), torch.zeros(n, dtype=torch.uint8, device="cuda")
        a1, a2 = torch.zeros(blocks, device="cuda"), torch.zeros(blocks, device="cuda")
    else:
        m1, m2, a1, a2 = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"), None, None
    param_amax = torch.full((1,), 1e9, device="cuda")
    lr, b1, b2 = (torch.tensor([v], device="cuda") for v in (1e-2, 0.9, 0.999))
    for step in range(3):
        grad = torch.randn(n, device="cuda").to(dtype)
        if step == 2:
            grad[n // 2] = float("nan")
        k.adamw_with_state(param, grad, m1, m2, master, compensation, a1, a2, param_amax, lr=lr, beta1_pow=b1,
                           beta2_pow=b2, weight_decay=0.1)
        expected = param.float().abs().max()  # torch's max propagates NaN as the kernel's does
        if step < 2:
            assert param_amax.item() == expected.item(), (layout, aligned, step)
        else:
            assert torch.isnan(param_amax).item() and torch.isnan(expected).item()
    outside = torch.cat([param_buf[:GUARD + offset], param_buf[GUARD + offset + n:]])
    assert torch.isnan(outside.float()).all(), "the kernel wrote outside the parameter's view"


@pytest.mark.parametrize("weight_copies", ["per_use", "cached"])
def test_fp8_weight_quantisations_take_the_optimizers_amax_bit_for_bit(weight_copies):
    """tests/torch_cpu/test_fp8_weight_amax_cpu.py's check on the GPU's kernels."""
    from tests.torch_cpu.test_fp8_weight_amax_cpu import check_quantisations_take_the_optimizers_amax

    check_quantisations_take_the_optimizers_amax("cuda", weight_copies)
