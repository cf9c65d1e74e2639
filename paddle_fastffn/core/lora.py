"""LoRA's adapted linear, written once: the Paddle patch (the LoRALinear forward of
integration/lora_forward.py, and fp8/linear.py's Fp8Linear over a LoRALinear) and the GPU harness
(paddle_fastffn/torch/llama.py, FastDecoderLayer._linear) both compute a LoRA projection here.

    y = base + scaling * (x @ A) @ B      base = the frozen layer's output, x after LoRA's dropout

LoRALinear's own forward writes `base + (x @ A @ B) * scaling`: the product [tokens, out] is
stored, scaled in one pass and added in another, and in backward the scale runs again over the
output gradient. Here the second GEMM accumulates into base with alpha = scaling (addmm, beta 1),
so the scale lives in the GEMM and base's gradient is the output gradient itself. On an H100 LoRA
r8 step of LLaMA-2-7B (4096 tokens, seven projections adapted) those separate passes measured
24.3 ms of bf16 adds and 14.5 ms of muls out of ~250 ms. The GEMM writes into base in place on both
sides (base is consumed: a projection's fresh output, which no backward reads), so the sum
allocates no second [tokens, out] buffer.

Two forms:
  LoraLinear (a fused op)  the base projection and the adapter as one autograd node, where LoRA's
      dropout is the identity (PaddleNLP's and PEFT's default, lora_dropout 0), every operand has one
      dtype and no autocast changes it. x has one consumer, so its gradient is one tensor: the
      base's input-gradient GEMM, then the adapter's share added into it in place (torch: one
      accumulating GEMM, addmm_; Paddle, whose matmul does not accumulate: a product and an add)
      where autograd would sum two [tokens, in] gradients in a new buffer (in the harness's
      LLaMA-2-7B LoRA step on an H100 those sums are 221 bf16 adds a step, 8.2 ms of kernels; the
      157 adds left are where several projections read one x).
      The base is the 16-bit GEMM of the framework (`be.linear`) or, with fp8_base, the FP8 linear
      (core/fp8/linear.py's Fp8LinearOp, run inside this op on its own backend).
  lora_linear (a composition of framework ops)  everywhere else: with dropout the adapter's input
      is another tensor than the base's, and autograd sums the two gradients as stock does.
"""

from __future__ import annotations

from .autograd import FusedOp, Saved
from .fp8.linear import Fp8LinearOp


def lora_linear(be, x, base, lora_a, lora_b, scaling: float):
    """base + scaling * linear(linear(x, A), B), differentiable by the framework's autograd.

    x: [..., in], the adapter's input (LoRA's dropout already applied: LoRALinear drops x before A);
    base: [..., out], the frozen projection of the undropped x (its Linear, FP8 GEMM or bias
    included), consumed: the sum may be written into it, in every grad mode; lora_a, lora_b: the
    adapter's weights in the framework's Linear layout (Paddle A [in, r], B [r, out]; torch A
    [r, in], B [out, r]). All of one dtype; the result [..., out] in it, the second GEMM
    accumulating in fp32 before its one rounding."""
    down = be.linear(x, lora_a)
    out = be.linear_accumulate(be.rows(base), be.rows(down), lora_b, scaling)
    return be.reshape(out, be.shape(base))


class Fp8Base:
    """LoraLinear's option for a base projection in FP8: Fp8LinearOp's backend (the framework's FP8
    backend: Paddle's emulated or CUDA one, torch's) and its options (the layer's scaling states,
    weight cache or None, FrozenFp8Weight or None)."""

    def __init__(self, backend, states, weight_cache=None, frozen_weight=None):
        self.backend, self.states = backend, states
        self.weight_cache, self.frozen_weight = weight_cache, frozen_weight


def fused_applies(be, x, dropped, weight, bias, lora_a, lora_b) -> bool:
    """Whether LoraLinear computes this projection: LoRA's dropout gave x back (the identity), no
    bias, and x, the base weight (when it is a tensor: None for one held only in FP8) and the
    adapter's weights share one dtype that this backend's GEMMs run in (not 16-bit on Paddle's
    CPU) with no autocast changing it. Elsewhere lora_linear keeps the framework's promotions: under
    AMP O1 autocast runs the GEMMs of fp32 tensors in 16 bits, inside the op's forward as outside,
    and its backward would meet 16-bit products beside the fp32 tensors it saved."""
    dtype = be.dtype(x)
    return (dropped is x and bias is None and be.gemm_dtype(x) == dtype and not be.autocast_changes_gemm(x)
            and all(be.dtype(t) == dtype for t in (lora_a, lora_b) + (() if weight is None else (weight,))))


class LoraLinear(FusedOp):
    """y = linear(x, weight) + scaling * linear(linear(x, A), B) for x [..., in] -> [..., out], the
    weights in the framework's Linear layout (lora_linear says which), one dtype (fused_applies).
    fp8_base (an Fp8Base): the base in FP8, weight None when fp8_base holds a FrozenFp8Weight.

    Forward: base GEMM, down = x @ A [tokens, r], then base += scaling * down @ B (one accumulating
    GEMM). Backward, from dy: d_down = scaling * dy @ B^T and dB = scaling * down^T @ dy (the
    backend's alpha: inside the GEMM on torch, a scale of the product on Paddle), dA = x^T @ d_down,
    dx = the base's input gradient (its 16-bit GEMM or Fp8LinearOp's backward) with d_down @ A^T
    accumulated into it in place, and the base weight's gradient where it is trained. Saved: x,
    down, A, B and the 16-bit weight each only where a gradient reads it, and Fp8LinearOp's own
    saved tensors (its FP8 copies): what lora_linear's three GEMM nodes keep."""

    inputs = ("x", "weight", "bias", "lora_a", "lora_b")
    options = ("scaling", "fp8_base")

    @staticmethod
    def forward(be, saved, x, weight, bias, lora_a, lora_b, scaling, fp8_base=None):
        if bias is not None:
            raise ValueError("LoraLinear: a base with a bias takes lora_linear (fused_applies)")
        need_x, need_w, _, need_a, need_b = saved.needs
        x_shape = be.shape(x)
        x2d = be.contiguous(be.rows(x))
        if fp8_base is None:
            base = be.linear(x2d, weight)
            base_kept = (weight if need_x else None,)
            saved.inner = None
        else:
            inner = Saved(saved.needs[:3])
            base = fp8_base.backend.rows(Fp8LinearOp.forward(
                fp8_base.backend, inner, x2d, weight, None, fp8_base.states, fp8_base.weight_cache,
                fp8_base.frozen_weight))
            # handed to the framework's saving with this op's own; held nowhere else (recompute and
            # offload see them)
            base_kept, inner.tensors = inner.tensors, ()
            saved.inner = inner
        down = be.linear(x2d, lora_a)
        out = be.linear_accumulate(base, down, lora_b, scaling)
        x_read = need_a or (need_w and fp8_base is None)
        saved.save(x2d if x_read else None, down if need_b else None, lora_a if need_x else None,
                   lora_b if need_x or need_a else None, *base_kept)
        saved.scaling, saved.fp8_base, saved.x_shape = scaling, fp8_base, x_shape
        return be.reshape(out, (*x_shape[:-1], be.shape(out)[-1]))

    @staticmethod
    def backward(be, saved, grad_output):
        x2d, down, lora_a, lora_b, *base_kept = saved.tensors
        need_x, need_w, _, need_a, need_b = saved.needs
        dy2d = be.contiguous(be.rows(grad_output))
        dx = dw = d_a = d_b = None
        d_down = None
        if need_x or need_a:
            d_down = be.linear_grad_input(dy2d, lora_b, saved.scaling)
        if need_b:
            d_b = be.linear_grad_weight(down, dy2d, saved.scaling)
        if need_a:
            d_a = be.linear_grad_weight(x2d, d_down)
        if saved.fp8_base is None:
            (weight,) = base_kept
            if need_x:
                dx = be.linear_grad_input(dy2d, weight)
            if need_w:
                dw = be.linear_grad_weight(x2d, dy2d)
        elif need_x or need_w:
            inner = saved.inner
            inner.tensors = tuple(base_kept)
            dx, dw, _ = Fp8LinearOp.backward(saved.fp8_base.backend, inner, dy2d)
            inner.tensors = ()
        if need_x:
            dx = be.rows(dx)
            be.linear_grad_input_accumulate(dx, d_down, lora_a)
            dx = be.reshape(dx, saved.x_shape)
        return dx, dw, None, d_a, d_b
