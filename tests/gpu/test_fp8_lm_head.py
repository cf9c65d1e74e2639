"""The FP8 LM head (paddle_fastffn.torch.ops.linear_cross_entropy with fp8_recipe: the product's
core/fp8/lm_head.py over the ctypes FP8 backend, cuBLASLt's FP8 GEMMs) against a float64 reference
of the same quantisation, stage by stage: the labelled rows in chunks through torch's own fp32 -> FP8
casts, h by the amax of every labelled row (e4m3), d_logits per chunk under its bound 1 / n (e5m2), W
once (e4m3), d_W summed over every chunk (core/fp8/lm_head.py's scales and its one d_W GEMM).
- The logits GEMM (fast accumulation, as every forward FP8 GEMM) against the float64 product of the
  dequantised operands, within test_fp8_kernels' fast-accumulation norm bound.
- The loss and the two gradient GEMMs from the logits the op computed (captured before the loss
  kernel overwrites them): a reference from exact logits would see fast accumulation's ~1e-3 move
  some d_logits across e5m2 rounding steps, 2^-2 apart. The kernel writes d_logits in the logits'
  dtype, which q(d_logits) reads; the reference rounds them the same way.
tests/torch_cpu/test_fp8_lm_head_cpu.py runs check_against_reference on the CPU harness."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from paddle_fastffn.core.fp8 import lm_head
from paddle_fastffn.core.fp8.lm_head import chunk_rows
from paddle_fastffn.torch import ops
from paddle_fastffn.torch.fp8.c_api import FP8_MAX
from paddle_fastffn.torch.fp8.ffn import Fp8Recipe
from tests.gpu.test_fp8_kernels import NORM_ERROR

IGNORE = -100
RECIPE = Fp8Recipe(lm_head="fp8")
# Norm-wise, the gradients against the reference built on the op's own logits: the gradient GEMMs'
# promoted FP8 accumulation (test_fp8_kernels' NORM_ERROR["fp8"], 2^-10), the outputs' rounding to bf16
# (2^-9), and the few elements of d_logits whose fp32 value (the kernel's) and float64 value (the
# reference's) fall on the two sides of an e5m2 rounding boundary. Measured on the CPU harness (3
# seeds, tests/torch_cpu/test_fp8_lm_head_cpu.py's shapes and one more): <= 1.8e-3 in bf16, 2.5e-5
# in fp32.
GRADIENT_RTOL = {torch.float32: NORM_ERROR["fp8"], torch.bfloat16: 2.0**-7}
# The loss, from the op's own logits: the loss kernel's fp32 log-sum-exp (__expf) against float64.
LOSS_RTOL = 1e-5
# The logits GEMM against float64: fast accumulation, plus the output's rounding to bf16.
LOGITS_RTOL = NORM_ERROR["fp8_fast"]


def dequantized(t: torch.Tensor, fmt: torch.dtype, bound: float | None = None) -> torch.Tensor:
    """float64 values of t quantised with its own amax (current scaling) or, given, a bound on |t|
    (the head's d_logits: the scale fmt_max / bound): the fp32 scale, the fp32 product saturated
    and rounded to nearest even by torch's cast. (test_fp8_linear_and_model's dequantized_ref makes
    its scale on the GPU; this one also runs on the CPU harness, tests/torch_cpu/test_fp8_lm_head_cpu.py.)"""
    t32 = t.float()
    if bound is not None:
        scale = torch.tensor(FP8_MAX[fmt] / bound, dtype=torch.float32, device=t.device)
        return (t32 * scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt).double() / scale.double()
    amax = t32.abs().max()
    scale = torch.where(amax > 0, torch.tensor(FP8_MAX[fmt], device=t.device) / amax, torch.ones_like(amax))
    codes = (t32 * scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt)
    return codes.double() / scale.double()


@contextlib.contextmanager
def logits_of_each_chunk():
    """[chunk logits]: what each chunk's FP8 logits GEMM returned, cloned before the loss kernel
    overwrites it with d_logits (padding rows included)."""
    chunks, original = [], lm_head.Fp8HeadGemms.logits

    def logits(self, h, out_dtype):
        out = original(self, h, out_dtype)
        chunks.append(out.detach().clone())
        return out

    lm_head.Fp8HeadGemms.logits = logits
    try:
        yield chunks
    finally:
        lm_head.Fp8HeadGemms.logits = original


def reference(hidden, weight, labels, chunk, transpose_weight, op_logits):
    """(loss, d_hidden, d_weight, worst logits error) in float64 (module docstring); op_logits:
    logits_of_each_chunk's."""
    w = (weight.t() if transpose_weight else weight)  # [H, V]
    wq = dequantized(w, torch.float8_e4m3fn)
    keep = torch.nonzero(labels != IGNORE)[:, 0]
    n = len(keep)
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    d_w = torch.zeros(w.shape, dtype=torch.float64, device=hidden.device)
    losses, logits_error = [], 0.0
    step = chunk_rows(chunk)
    starts = range(0, n, step)
    assert len(op_logits) == len(starts), f"{len(op_logits)} logits GEMMs for {len(starts)} chunks"
    hq_all = dequantized(hidden[keep], torch.float8_e4m3fn)  # one scale for every labelled row
    for start, computed in zip(starts, op_logits):
        rows = keep[start:start + step]
        hq = hq_all[start:start + step]
        logits = computed[:len(rows)].double()
        logits_error = max(logits_error, rel_err(logits, hq @ wq))
        target = labels[rows]
        losses.append(F.cross_entropy(logits, target, reduction="none"))
        d_logits = torch.softmax(logits, 1)
        d_logits[torch.arange(len(rows), device=hidden.device), target] -= 1.0
        dlq = dequantized((d_logits / n).to(hidden.dtype), torch.float8_e5m2, bound=1.0 / n)
        d_hidden[rows] = dlq @ wq.t()
        d_w += hq.t() @ dlq
    loss_rows = torch.cat(losses)
    return (loss_rows[loss_rows > 0].mean(), d_hidden, (d_w.t() if transpose_weight else d_w), logits_error)


def rel_err(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def check_against_reference(tokens, width, vocab, chunk, transpose_weight, dtype, device="cuda"):
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, device=device).to(dtype).requires_grad_()
    w_shape = (vocab, width) if transpose_weight else (width, vocab)
    weight = (torch.randn(w_shape, device=device) * 3 / math.sqrt(width)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[torch.rand(tokens, device=device) < 0.25] = IGNORE
    with logits_of_each_chunk() as op_logits:
        loss = ops.linear_cross_entropy(hidden, weight, labels, IGNORE, transpose_weight, chunk, fp8_recipe=RECIPE)
    loss.backward()
    default_chunk = ops.core_lce.default_chunk_tokens(vocab, on_gpu=True)
    ref_loss, ref_dh, ref_dw, logits_error = reference(hidden.detach(), weight.detach(), labels,
                                                       chunk or default_chunk, transpose_weight, op_logits)
    assert logits_error <= LOGITS_RTOL, logits_error
    assert abs(loss.item() - ref_loss.item()) <= LOSS_RTOL * abs(ref_loss.item()), (loss.item(), ref_loss.item())
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    rtol = GRADIENT_RTOL[dtype]
    assert rel_err(hidden.grad, ref_dh) <= rtol, rel_err(hidden.grad, ref_dh)
    assert rel_err(weight.grad, ref_dw) <= rtol, rel_err(weight.grad, ref_dw)
    assert not hidden.grad[labels == IGNORE].any()


# (tokens, hidden, vocab, chunk): several chunks with a padded last one; LLaMA-2's vocabulary at 7B
# width in one chunk; LLaMA-3's vocabulary in the default chunks (2080 rows: about 3000 of the 4000
# tokens are labelled, so two chunks, both writing their rows of the one d_W GEMM's operands).
SHAPES = [(300, 128, 512, 100), (1024, 4096, 32000, None), (4000, 256, 128256, None)]


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


def check_frozen_hidden_gives_the_same_d_weight(device="cuda"):
    """Frozen hidden states over several chunks: no d_h GEMM and no row-wise q(d_logits) (each
    chunk's quantisation writes its transposed copy alone, into the call's storage); the same d_W
    as when both are trained."""
    torch.manual_seed(2)
    hidden = torch.randn(300, 128, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(128, 512, device=device) / 11).to(torch.bfloat16)
    labels = torch.randint(0, 512, (300,), device=device)
    grads = []
    for hidden_trained in (True, False):
        h, w = hidden.clone().requires_grad_(hidden_trained), weight.clone().requires_grad_()
        ops.linear_cross_entropy(h, w, labels, chunk_tokens=100, fp8_recipe=RECIPE).backward()
        assert (h.grad is not None) == hidden_trained
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


def test_fp8_head_of_frozen_hidden_states_gives_d_weight_alone():
    check_frozen_hidden_gives_the_same_d_weight()


def check_rejections(device="cuda"):
    """What cuBLASLt's FP8 GEMMs cannot take is an error naming the arguments and why."""
    labels = torch.zeros(64, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="`hidden` and `weight` cannot run the FP8 LM head: hidden size 40 or "
                                         "vocabulary 128 is not a multiple of 16"):
        ops.linear_cross_entropy(torch.randn(64, 40, device=device, dtype=torch.bfloat16),
                                 torch.randn(40, 128, device=device, dtype=torch.bfloat16), labels, fp8_recipe=RECIPE)
    with pytest.raises(ValueError, match="cannot run the FP8 LM head: the hidden states are torch.float16, not bf16"):
        ops.linear_cross_entropy(torch.randn(64, 64, device=device, dtype=torch.float16),
                                 torch.randn(64, 128, device=device, dtype=torch.float16), labels, fp8_recipe=RECIPE)


def test_fp8_head_rejects_what_cublaslt_fp8_cannot_take():
    check_rejections()
