"""The FP8 linear layer (paddle_fastffn/torch/fp8/linear.py), the decoder layer with FP8 linears and the
whole fast-path model with its master-weight AdamW (paddle_fastffn/torch/llama.py), through the
ctypes harness.

References: each GEMM of the FP8 linear against the float64 GEMM of its FP8 operands, which are
rebuilt from the inputs with the exact quantisation reference of test_fp8_kernels (so a wrong
scale, a wrong copy or a wrong layout fails); the FP8 decoder layer against the bf16 one within
the FP8 error budget; the whole model against Hugging Face's LlamaForCausalLM in fp32 (loss and
gradients); the optimizer against torch's AdamW on fp32 parameters."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_checks import close  # noqa: E402
from test_fp8_kernels import E4M3, E5M2, assert_gemm_close, quantize_ref  # noqa: E402
from test_swiglu_fp8_kernels import FP8_BUDGET, rel_err, scale_rule  # noqa: E402
from fp8_ffn_budget import rss  # noqa: E402

from paddle_fastffn.torch import ops  # noqa: E402
from paddle_fastffn.torch.fp8 import c_api as fp8  # noqa: E402
from paddle_fastffn.torch.fp8.ffn import Fp8Recipe  # noqa: E402
from paddle_fastffn.torch.fp8.linear import Fp8LinearState, fp8_linear  # noqa: E402

transformers = pytest.importorskip("transformers")


def dequantized_ref(t: torch.Tensor, fmt) -> tuple[torch.Tensor, np.float32]:
    """float64 values of t quantised with current scaling (its own amax), and the scale."""
    scale = scale_rule(float(t.float().abs().max()), 1.0, fp8.FP8_MAX[fmt], 0.0)
    codes = quantize_ref(t, fp8.scalar(float(scale)), fmt)
    return codes.view(fmt).float().double() / float(scale), scale


# (T, in, out): the smallest aligned shape, a fused-QKV-like GQA width, a 7B o_proj at 2k tokens.
LINEAR_SHAPES = [(16, 16, 32), (48, 256, 384), (2048, 4096, 4096)]


@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=str)
def test_fp8_linear_runs_the_three_gemms_of_its_fp8_operands(shape):
    t, n_in, n_out = shape
    x = torch.randn(t, n_in, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(n_out, n_in, device="cuda") / math.sqrt(n_in)).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(t, n_out, device="cuda").to(torch.bfloat16)
    state = Fp8LinearState(Fp8Recipe("current"))
    y = fp8_linear(x, w, state)
    y.backward(dy)
    x64, sx = dequantized_ref(x.detach(), E4M3)
    w64, sw = dequantized_ref(w.detach(), E4M3)
    dy64, sdy = dequantized_ref(dy, E5M2)
    for s, st, what in ((sx, state.x, "x"), (sw, state.weight, "W"), (sdy, state.dy, "dy")):
        assert np.float32(st.scale.item()) == s, f"{what}: the current-scaling scale"
    assert y.dtype == x.dtype and x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    assert_gemm_close(y, x64 @ w64.t(), x64.abs() @ w64.abs().t(), n_in, "fp8_fast", f"y {shape}")
    assert_gemm_close(x.grad, dy64 @ w64, dy64.abs() @ w64.abs(), n_out, "fp8", f"dx {shape}")
    assert_gemm_close(w.grad, dy64.t() @ x64, dy64.abs().t() @ x64.abs(), t, "fp8", f"dW {shape}")
    assert state.cache.quantizations == 0, "per use (the default): no FP8 weight copy kept"


@pytest.mark.parametrize("shape", [(64, 128, 256), (4096, 4096, 11008)], ids=str)
def test_fp8_linear_weight_per_use_is_the_cached_weight_bit_for_bit(shape):
    """Fp8Recipe.weight_copies "per_use" (the dgrad copy quantised in backward, from the weight and
    the forward's scale) against "cached" (both copies from the cache): y, dx and dW equal bit for
    bit, on the CUDA kernels."""
    t, n_in, n_out = shape
    torch.manual_seed(0)
    x0 = torch.randn(t, n_in, device="cuda").to(torch.bfloat16)
    w0 = (torch.randn(n_out, n_in, device="cuda") / math.sqrt(n_in)).to(torch.bfloat16)
    dy = torch.randn(t, n_out, device="cuda").to(torch.bfloat16)
    got = {}
    for mode in ("per_use", "cached"):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        state = Fp8LinearState(Fp8Recipe("delayed", weight_copies=mode))
        y = fp8_linear(x, w, state)
        y.backward(dy)
        got[mode] = (y, x.grad, w.grad)
        assert state.cache.quantizations == (1 if mode == "cached" else 0)
    for name, a, b in zip(("y", "dx", "dW"), got["per_use"], got["cached"]):
        assert torch.equal(a, b), name


def test_fp8_linear_delayed_scaling_and_the_weight_cache():
    """Delayed: x and dy use the scale of their history (the first step: their own amax's, the
    warm start, which seeds the history); the weight is current-scaled and quantised once per
    version (an in-place write re-quantises it)."""
    t, n_in, n_out = 64, 128, 256
    w = (torch.randn(n_out, n_in, device="cuda") / math.sqrt(n_in)).to(torch.bfloat16).requires_grad_()
    state = Fp8LinearState(Fp8Recipe("delayed", amax_history_len=4, weight_copies="cached"))
    x = torch.randn(t, n_in, device="cuda").to(torch.bfloat16).requires_grad_()
    dy = torch.randn(t, n_out, device="cuda").to(torch.bfloat16)
    fp8_linear(x, w, state).backward(dy)
    assert state.x.scale.item() == float(scale_rule(float(x.detach().float().abs().max()), 1.0, 448.0, 0.0))
    assert state.dy.scale.item() == float(scale_rule(float(dy.float().abs().max()), 1.0, 57344.0, 0.0))
    _, sw = dequantized_ref(w.detach(), E4M3)
    assert np.float32(state.weight.scale.item()) == sw, "weights: current scaling under both recipes"
    fp8_linear(x, w, state).backward(dy)
    assert state.cache.quantizations == 1, "cached within the step"
    with torch.no_grad():
        w.mul_(0.5)  # torch's version counter moves: the next use re-quantises (core/fp8/weight_cache.py)
    fp8_linear(x, w, state)
    assert state.cache.quantizations == 2
    assert np.float32(state.weight.scale.item()) == dequantized_ref(w.detach(), E4M3)[1], "the new weight's scale"
    state.cache.invalidate()
    fp8_linear(x, w, state)
    assert state.cache.quantizations == 3


def test_fp8_linear_rejects_what_cublaslt_cannot_take():
    state = Fp8LinearState()
    w = torch.randn(32, 48, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"tokens T = 10 not a positive multiple of 16.*pad"):
        fp8_linear(torch.randn(10, 48, device="cuda", dtype=torch.bfloat16), w, state)
    with pytest.raises(ValueError, match=r"in_features K = 40"):
        fp8_linear(torch.randn(16, 40, device="cuda", dtype=torch.bfloat16), torch.randn(32, 40, device="cuda",
                                                                                          dtype=torch.bfloat16), state)
    with pytest.raises(ValueError, match=r"does not fit inputs of width 64"):
        fp8_linear(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16), w, state)
    assert state.cache.quantizations == 0


def _tiny_config(**overrides):
    values = dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-5, max_position_embeddings=128, vocab_size=1000, num_hidden_layers=3,
                  tie_word_embeddings=False)
    values.update(overrides)
    config = transformers.LlamaConfig(**values)
    config._attn_implementation = "sdpa"
    return config


# The decoder layer with FP8 linears, against the same layer in bf16: four FP8 linears in a row
# (qkv, o, the FFN's two) each add about the budget of one FP8 GEMM pair, and attention and the
# norms pass relative errors on roughly unchanged. Budget: the FFN's output budget (two chained
# FP8 GEMMs with SwiGLU between) for the attention half plus the FFN's, added in quadrature.
DECODER_FP8_BUDGET = rss(FP8_BUDGET["y"], FP8_BUDGET["y"])


def _bf16_hf_decoder_layer(config):
    """A Hugging Face LlamaDecoderLayer in bf16 with weights of unit-scale outputs."""
    from transformers.models.llama import modeling_llama

    hf = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 1 / math.sqrt(p.shape[-1])) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return hf


def _assert_fp8_layer_within_budget(config, bf16, ours, gradients, steps, label):
    """ours (FP8) against bf16 (the same layer in bf16) on one random input [2, 64, 256]: the
    output's update (output - residual), d_x and gradients(layer) -> {name: tensor}, after `steps`
    forward+backward passes of ours (delayed scaling: the calibration steps first), each followed
    by invalidate_fp8_weights as after an optimizer step."""
    from paddle_fastffn.torch.llama import rope_tables

    cos, sin = rope_tables(config, 64)
    x = torch.randn(2, 64, 256, device="cuda").to(torch.bfloat16)
    dy = torch.randn(2, 64, 256, device="cuda").to(torch.bfloat16)

    def run(layer):
        xi = x.clone().requires_grad_()
        out = layer(xi, cos, sin)
        out.backward(dy)
        return {"layer output - residual": out.detach() - x, "d_x": xi.grad, **gradients(layer)}

    ref = run(bf16)
    for _ in range(steps):
        for p in ours.parameters():
            p.grad = None
        got = run(ours)
        ours.invalidate_fp8_weights()
    for name, g in got.items():
        assert torch.isfinite(g).all(), name
        err = rel_err(g, ref[name])
        print(f"{label} {name}: fp8 vs bf16 {err:.4f} (budget {DECODER_FP8_BUDGET:.3f})")
        assert err <= DECODER_FP8_BUDGET, f"{label} {name}: {err}"


@pytest.mark.parametrize("kind", ["current", "delayed"])
def test_decoder_layer_with_fp8_linears_stays_within_the_fp8_budget_of_bf16(kind):
    from paddle_fastffn.torch.llama import FastDecoderLayer

    config = _tiny_config()
    hf = _bf16_hf_decoder_layer(config)
    bf16 = FastDecoderLayer(hf, 4, 2, config.rms_norm_eps).to("cuda")
    ours = FastDecoderLayer(hf, 4, 2, config.rms_norm_eps, fp8_recipe=Fp8Recipe(kind, amax_history_len=4)).to("cuda")
    weight_grads = lambda layer: {"d_w_qkv": layer.w_qkv.grad, "d_w_down": layer.w_down.grad}  # noqa: E731
    _assert_fp8_layer_within_budget(config, bf16, ours, weight_grads, 3 if kind == "delayed" else 1, kind)
    assert not ours.fp8["qkv"].cache.cached() and not ours.fp8["ffn"].cache.cached(), "per use: no FP8 weight kept"


def test_lora_decoder_layer_with_fp8_base_gemms_stays_within_the_fp8_budget_of_bf16():
    """The full-depth benchmark's FP8 LoRA layer (each projection's frozen base GEMM through
    fp8_linear, delayed scaling, adapters in bf16) against the same LoRA layer in bf16: seven FP8
    linears, two chains of them per half (q/k/v -> o, gate/up -> down), the decoder budget. The
    frozen weights are quantised once, at construction, into the FP8 copy each forward GEMM reads
    (Fp8Recipe.frozen_weights "fp8"; the 16-bit weights leave the GPU), and never again."""
    from paddle_fastffn.torch.llama import UNFUSED_PROJECTIONS, FastDecoderLayer, LoraSettings

    config = _tiny_config()
    hf = _bf16_hf_decoder_layer(config)
    lora = LoraSettings(rank=8, alpha=16)
    torch.manual_seed(3)
    bf16 = FastDecoderLayer(hf, 4, 2, config.rms_norm_eps, lora=lora).to("cuda")
    # built on the GPU from hf's weights there (a later .to("cuda") would bring the host copies back)
    ours = FastDecoderLayer(hf, 4, 2, config.rms_norm_eps, fp8_recipe=Fp8Recipe("delayed", amax_history_len=4),
                            lora=lora)
    with torch.no_grad():
        for name, _, _ in UNFUSED_PROJECTIONS:
            bf16.lora_b[name].normal_(0, 0.05)  # B starts at zero: give the adapters something to add
            ours.lora_a[name].copy_(bf16.lora_a[name])
            ours.lora_b[name].copy_(bf16.lora_b[name])
    adapter_grads = lambda layer: {"d_lora_A q": layer.lora_a["q"].grad,  # noqa: E731
                                   "d_lora_B down": layer.lora_b["down"].grad}
    _assert_fp8_layer_within_budget(config, bf16, ours, adapter_grads, 3, "fp8 lora")
    assert set(ours.frozen_fp8) == {name for name, _, _ in UNFUSED_PROJECTIONS}
    assert all(ours.fp8[name].cache.quantizations == 0 for name, _, _ in UNFUSED_PROJECTIONS)
    assert all(not getattr(ours, attribute).is_cuda for _, attribute, _ in UNFUSED_PROJECTIONS)


def _scaling_states(layer):
    """{name.role: ScalingState} of a FastDecoderLayer's FP8 linears and FFN."""
    from paddle_fastffn.torch.fp8.ffn import ScalingState

    return {f"{name}.{role}": value for name, state in layer.fp8.items() for role, value in vars(state).items()
            if isinstance(value, ScalingState)}


def _hf_model(config, dtype):
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = modeling_llama.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.to(dtype)


def gradient_pairs(ours, hf) -> list:
    """(ours, Hugging Face's, name) for the gradients the FastLlama-vs-HF tests compare: embedding,
    LM head (ours [H, V]), final norm, a down projection and the q and k rows of the fused QKV
    (PaddleNLP's interleaved layout, split back per projection)."""
    attention = hf.model.layers[0].self_attn
    layer = ours.layers[0]
    d_w_q, d_w_k, _ = ops.split_qkv_weight(layer.w_qkv.grad, layer.heads, layer.kv_heads)
    return [(ours.embed.grad, hf.model.embed_tokens.weight.grad, "d_embed"),
            (ours.w_lm_head.grad, hf.lm_head.weight.grad.t(), "d_lm_head"),
            (ours.w_norm.grad, hf.model.norm.weight.grad, "d_norm"),
            (ours.layers[1].w_down.grad, hf.model.layers[1].mlp.down_proj.weight.grad, "d_w_down[1]"),
            (d_w_q, attention.q_proj.weight.grad, "d_w_q[0]"),
            (d_w_k, attention.k_proj.weight.grad, "d_w_k[0]")]


def test_fast_llama_loss_and_gradients_match_hugging_face_in_fp32():
    """FastLlama (embedding, the composition's layers, final norm, fused linear cross-entropy on
    the [H, V] head) computes LlamaForCausalLM's loss and gradients, labels shifted outside."""
    from paddle_fastffn.torch.llama import FastLlama, shift_labels

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = _tiny_config()
    hf = _hf_model(config, torch.float32)
    ours = FastLlama(hf)
    ids = torch.randint(0, config.vocab_size, (2, 48), device="cuda")
    ref = hf(input_ids=ids, labels=ids).loss
    ref.backward()
    got = ours(ids, shift_labels(ids))
    got.backward()
    # fp32 throughout: only summation orders differ; the longest reduction is the vocabulary's.
    close(got, ref, torch.float32, "loss")
    for g, r, name in gradient_pairs(ours, hf):
        close(g, r, torch.float32, name, reduced_rows=1000)


def test_master_weight_adamw_is_adamw_on_fp32_masters():
    """bf16 parameters: the masters follow torch's AdamW on fp32 copies given the same (upcast)
    gradients; the parameters are the masters rounded to bf16."""
    from paddle_fastffn.torch.llama import MasterWeightAdamW

    params = [torch.randn(64, 48, device="cuda").to(torch.bfloat16).requires_grad_(),
              torch.randn(48, device="cuda").requires_grad_()]  # a fp32 parameter updates in place
    ref = [p.detach().float().clone().requires_grad_() for p in params]
    opt = MasterWeightAdamW(params, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    for _ in range(3):
        grads = [torch.randn(p.shape, device="cuda").to(p.dtype) for p in params]
        for p, r, g in zip(params, ref, grads):
            p.grad, r.grad = g.clone(), g.float()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    for p, m, r in zip(params, opt.masters, ref):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-6)  # fused vs for-each kernels
        assert torch.equal(p.detach(), m.to(p.dtype)), "parameters = masters rounded"
    assert all(p.grad is None for p in params)


def test_fast_llama_delayed_scaling_first_step_is_calibrated():
    """The warm start (Fp8Recipe.delayed_warm_start): FastLlama's first step under delayed scaling
    quantises every tensor with its own amax, as current scaling does, so its loss is current
    scaling's bit for bit (the gradients pass SDPA's backward, whose atomics make bits vary); every
    scaling state, the gradients' included, leaves the step with an amax in its history and a
    scale other than the initial 1. TE's start (scales of 1) gives another first loss."""
    from paddle_fastffn.torch.llama import FastLlama, shift_labels

    config = _tiny_config()
    base = _hf_model(config, torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (4, 64), device="cuda")

    def first_step(recipe):
        model = FastLlama(base, fp8_recipe=recipe)
        loss = model(ids, shift_labels(ids))
        loss.backward()
        return model, loss.detach()

    _, loss_current = first_step(Fp8Recipe("current"))
    model, loss = first_step(Fp8Recipe("delayed", amax_history_len=8))
    assert torch.equal(loss, loss_current)
    for index, layer in enumerate(model.layers):
        for name, state in _scaling_states(layer).items():
            assert state.seeded and state.amax_history.max().item() > 0, f"layer {index} {name}: no amax"
            assert state.scale.item() != 1.0, f"layer {index} {name}: still the initial scale"
    _, loss_te = first_step(Fp8Recipe("delayed", amax_history_len=8, delayed_warm_start=False))
    assert not torch.equal(loss_te, loss_current)


@pytest.mark.parametrize("kind", [None, "current", "delayed"], ids=["bf16", "fp8_current", "fp8_delayed"])
def test_fast_llama_trains(kind):
    """A few AdamW steps of the tiny model on one repeated batch: the loss falls, FP8 recipes
    included (weights re-quantised after every step)."""
    from paddle_fastffn.torch.llama import FastLlama, MasterWeightAdamW, shift_labels

    config = _tiny_config()
    recipe = None if kind is None else Fp8Recipe(kind, amax_history_len=8)
    model = FastLlama(_hf_model(config, torch.bfloat16), fp8_recipe=recipe)
    opt = MasterWeightAdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, config.vocab_size, (4, 64), device="cuda")
    labels = shift_labels(ids)
    losses = []
    for _ in range(12):
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.invalidate_fp8_weights()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.7 * losses[0], losses
    if kind is not None:
        assert model.layers[1].fp8["ffn"].cache.quantizations == 0, "per use (the default): nothing cached"
