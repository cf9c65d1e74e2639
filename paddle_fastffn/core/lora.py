"""LoRA's adapted linear, written once: the Paddle patch (the LoRALinear forward of
integration/lora_forward.py, and fp8/linear.py's Fp8Linear over a LoRALinear) and the GPU harness
(paddle_fastffn/torch/llama.py, FastDecoderLayer._linear) both compute a LoRA projection here.

    y = base + scaling * (x @ A) @ B      base = the frozen layer's output, x after LoRA's dropout

LoRALinear's own forward writes `base + (x @ A @ B) * scaling`: the product [tokens, out] is
stored, scaled in one pass and added in another, and in backward the scale runs again over the
output gradient. Here the second GEMM accumulates into base with alpha = scaling (addmm, beta 1),
so the scale lives in the GEMM in both directions and base's gradient is the output gradient
itself. On an H100 LoRA r8 step of LLaMA-2-7B (4096 tokens, seven projections adapted) those
separate passes measured 24.3 ms of bf16 adds and 14.5 ms of muls out of ~250 ms. The GEMM writes
into base in place on both sides (base is consumed: a projection's fresh output, which no backward
reads), so the sum allocates no second [tokens, out] buffer.
Autograd's sum of x's two gradients (the base GEMM's and the adapter's) stays the framework's.
"""

from __future__ import annotations


def lora_linear(be, x, base, lora_a, lora_b, scaling: float):
    """base + scaling * linear(linear(x, A), B), differentiable by the framework's autograd.

    x: [..., in], the adapter's input (LoRA's dropout already applied: LoRALinear drops x before A);
    base: [..., out], the frozen projection of the undropped x (its Linear, FP8 GEMM or bias
    included), consumed: the sum may be written into it, in every grad mode; lora_a, lora_b: the adapter's weights in the framework's Linear layout (Paddle A
    [in, r], B [r, out]; torch A [r, in], B [out, r]). All of one dtype; the result [..., out] in it,
    the second GEMM accumulating in fp32 before its one rounding."""
    down = be.linear(x, lora_a)
    out = be.linear_accumulate(be.rows(base), be.rows(down), lora_b, scaling)
    return be.reshape(out, be.shape(base))
