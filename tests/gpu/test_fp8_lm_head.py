"""The FP8 LM head (paddle_fastffn.torch.ops.linear_cross_entropy with fp8_recipe: the product's
core/fp8/lm_head.py over the ctypes FP8 backend, cuBLASLt's FP8 GEMMs) against a float64 reference
of the same quantisation: the labelled rows in chunks, h and d_logits quantised per chunk by their
own amax (e4m3, e5m2) through torch's own fp32 -> FP8 casts, W once (e4m3), the logits rounded to
the dtype the GEMM stores them in, as test_cross_entropy_kernels' reference does, and so d_logits,
which the loss kernel writes over them.
tests/torch_cpu/test_fp8_lm_head_cpu.py runs check_against_reference on the CPU harness."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from paddle_fastffn.core.fp8.lm_head import chunk_rows
from paddle_fastffn.torch import ops
from paddle_fastffn.torch.fp8.ffn import Fp8Recipe

IGNORE = -100
RECIPE = Fp8Recipe(lm_head="fp8")
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Norm-wise, against the reference of the same quantisation: the outputs' rounding to bf16 (2^-9)
# and the few elements of d_logits whose fp32 value (the kernel's, from bf16 logits) and float64
# value (the reference's) fall on the two sides of an e5m2 rounding boundary. Measured on the CPU
# harness (3 seeds, tests/torch_cpu/test_fp8_lm_head_cpu.py's shapes and one more): <= 1.8e-3 in bf16,
# 2.5e-5 in fp32, 1.3e-7 for the loss.
SAME_QUANTISATION_RTOL = {torch.float32: 1e-3, torch.bfloat16: 2.0**-7}


def dequantized(t: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """float64 values of t quantised with its own amax (current scaling): the fp32 scale
    fmt_max / amax, the fp32 product saturated and rounded to nearest even by torch's cast."""
    t32 = t.float()
    amax = t32.abs().max()
    scale = torch.where(amax > 0, torch.tensor(FP8_MAX[fmt], device=t.device) / amax, torch.ones_like(amax))
    codes = (t32 * scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt)
    return codes.double() / scale.double()


def reference(hidden, weight, labels, chunk, transpose_weight):
    """(loss, d_hidden, d_weight) in float64 (module docstring)."""
    w = (weight.t() if transpose_weight else weight)  # [H, V]
    wq = dequantized(w, torch.float8_e4m3fn)
    keep = torch.nonzero(labels != IGNORE)[:, 0]
    n = len(keep)
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    d_w = torch.zeros(w.shape, dtype=torch.float64, device=hidden.device)
    losses = []
    step = chunk_rows(chunk)
    for start in range(0, n, step):
        rows = keep[start:start + step]
        hq = dequantized(hidden[rows], torch.float8_e4m3fn)
        logits = (hq @ wq).to(hidden.dtype).double()
        target = labels[rows]
        losses.append(F.cross_entropy(logits, target, reduction="none"))
        d_logits = torch.softmax(logits, 1)
        d_logits[torch.arange(len(rows), device=hidden.device), target] -= 1.0
        # the kernel writes d_logits over the logits, in their dtype, and q(d_logits) reads that
        dlq = dequantized((d_logits / n).to(hidden.dtype), torch.float8_e5m2)
        d_hidden[rows] = dlq @ wq.t()
        d_w += hq.t() @ dlq
    loss_rows = torch.cat(losses)
    return loss_rows[loss_rows > 0].mean(), d_hidden, (d_w.t() if transpose_weight else d_w)


def rel_err(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def check_against_reference(tokens, width, vocab, chunk, transpose_weight, dtype, device="cuda"):
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, device=device).to(dtype).requires_grad_()
    w_shape = (vocab, width) if transpose_weight else (width, vocab)
    weight = (torch.randn(w_shape, device=device) * 3 / math.sqrt(width)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[torch.rand(tokens, device=device) < 0.25] = IGNORE
    loss = ops.linear_cross_entropy(hidden, weight, labels, IGNORE, transpose_weight, chunk, fp8_recipe=RECIPE)
    loss.backward()
    default_chunk = ops.core_lce.default_chunk_tokens(vocab, on_gpu=True)
    ref_loss, ref_dh, ref_dw = reference(hidden.detach(), weight.detach(), labels, chunk or default_chunk,
                                         transpose_weight)
    rtol = SAME_QUANTISATION_RTOL[dtype]
    assert abs(loss.item() - ref_loss.item()) <= rtol * abs(ref_loss.item()), (loss.item(), ref_loss.item())
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    assert rel_err(hidden.grad, ref_dh) <= rtol, rel_err(hidden.grad, ref_dh)
    assert rel_err(weight.grad, ref_dw) <= rtol, rel_err(weight.grad, ref_dw)
    assert not hidden.grad[labels == IGNORE].any()


# (tokens, hidden, vocab, chunk): several chunks with a padded last one; LLaMA-2's vocabulary at 7B
# width in one chunk; LLaMA-3's vocabulary in the default chunks (two).
SHAPES = [(300, 128, 512, 100), (1024, 4096, 32000, None), (2500, 256, 128256, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("transpose_weight", [False, True], ids=["head", "tied"])
@pytest.mark.parametrize("tokens,width,vocab,chunk", SHAPES, ids=str)
def test_fp8_head_matches_the_reference_of_its_quantisation(tokens, width, vocab, chunk, transpose_weight, dtype):
    check_against_reference(tokens, width, vocab, chunk, transpose_weight, dtype)


def test_fp8_head_of_a_frozen_weight_gives_d_hidden_alone():
    """LoRA's frozen head: q(W)'s input-gradient copy, no d_W GEMM; the same d_hidden."""
    torch.manual_seed(1)
    hidden = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(256, 1024, device="cuda") / 16).to(torch.bfloat16)
    labels = torch.randint(0, 1024, (512,), device="cuda")
    grads = []
    for trained in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trained)
        ops.linear_cross_entropy(h, w, labels, fp8_recipe=RECIPE).backward()
        assert (w.grad is not None) == trained
        grads.append(h.grad)
    assert torch.equal(grads[0], grads[1])


def test_fp8_head_rejects_what_cublaslt_fp8_cannot_take():
    hidden = torch.randn(64, 40, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="H, V multiples of 16"):
        ops.linear_cross_entropy(hidden, torch.randn(40, 128, device="cuda", dtype=torch.bfloat16),
                                 torch.zeros(64, dtype=torch.long, device="cuda"), fp8_recipe=RECIPE)
    with pytest.raises(ValueError, match="bf16 or fp32 hidden"):
        ops.linear_cross_entropy(torch.randn(64, 64, device="cuda", dtype=torch.float16),
                                 torch.randn(64, 128, device="cuda", dtype=torch.float16),
                                 torch.zeros(64, dtype=torch.long, device="cuda"), fp8_recipe=RECIPE)
