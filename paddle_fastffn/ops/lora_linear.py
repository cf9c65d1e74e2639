"""A LoRA projection as one autograd node: core/lora.py's LoraLinear (the base GEMM, 16-bit or FP8,
and the adapter, with x's gradient written once) through Paddle's PyLayer adapter. The LoRALinear
forward of integration/lora_forward.py and fp8/linear.py's Fp8Linear call it where
core.lora.fused_applies holds; the torch harness runs the same class (torch/ops.py LoraLinear)."""

from __future__ import annotations

from ..core import lora as core
from ._autograd import pylayer

_LoraLinear = pylayer(core.LoraLinear)


def lora_linear_fused(x, weight, lora_a, lora_b, scaling: float, fp8_base: core.Fp8Base | None = None):
    """linear(x, weight) + scaling * linear(linear(x, lora_a), lora_b) for x [..., in] -> [..., out]
    (Paddle layouts: weight [in, out], lora_a [in, r], lora_b [r, out]; one dtype, no bias: the
    caller checked core.lora.fused_applies). fp8_base: the base in FP8 (weight None when it holds a
    FrozenFp8Weight)."""
    return _LoraLinear.apply(x, weight, None, lora_a, lora_b, float(scaling), fp8_base)
