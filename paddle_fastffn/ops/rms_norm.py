"""RMSNorm and residual-add + RMSNorm, with PaddleNLP LlamaRMSNorm numerics.

Stack: core op (paddle_fastffn/core/rms_norm.py, over ops/_backend.py's compiled-op calls) ->
autograd (``pylayer(core op)``) -> public ``rms_norm`` / ``fused_add_rms_norm`` -> ``rms_norm_ref`` /
``fused_add_rms_norm_ref``.
"""

from __future__ import annotations

import paddle

from ..core import rms_norm as core
from . import _checks
from ._autograd import pylayer
from ._fallback import warn_fallback

OP = "paddle_fastffn.ops.rms_norm"

_RMSNorm = pylayer(core.RMSNorm)
_AddRMSNorm = pylayer(core.AddRMSNorm)


def _check_norm_inputs(x, weight, epsilon):
    _checks.check_float(x, OP, "x")
    _checks.check_float(weight, OP, "weight")
    if len(x.shape) == 0 or list(weight.shape) != [x.shape[-1]]:
        raise ValueError(f"{OP}: `weight` must be 1-D of size x.shape[-1]; got x {list(x.shape)}, "
                         f"weight {list(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{OP}: `weight` ({weight.dtype}) must have the dtype of `x` ({x.dtype}); "
                        f"under AMP O2 both are low precision, under O1/fp32 both are float32")
    _checks.check_same_device(x, "x", weight, OP, "weight")
    if not float(epsilon) >= 0.0:
        raise ValueError(f"{OP}: `epsilon` must be a non-negative float, got {epsilon}")


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, epsilon: float = 1e-6) -> paddle.Tensor:
    """``x / sqrt(mean(x^2) + epsilon) * weight`` over the last axis.

    x: [..., H], weight: [H], same dtype -> fp32 statistics -> normalised row rounded to the dtype
    -> times weight -> same dtype (PaddleNLP LlamaRMSNorm casting). Gradients for x and weight.
    """
    _check_norm_inputs(x, weight, epsilon)
    if not _checks.kernel_supports_place(x):
        warn_fallback(OP, x.place)
        return rms_norm_ref(x, weight, epsilon)
    return _RMSNorm.apply(_checks.contiguous(x), weight, float(epsilon))


def fused_add_rms_norm(x: paddle.Tensor, residual: paddle.Tensor, weight: paddle.Tensor,
                       epsilon: float = 1e-6) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass: the decoder layer's residual add
    fused with the norm that follows it.

    x, residual: [..., H]; weight: [H]; one dtype. The sum is rounded to that dtype (as the unfused
    add stores it) before it is normalised. Gradients for x, residual and weight.
    """
    _check_norm_inputs(x, weight, epsilon)
    _checks.check_like(x, "x", residual, OP, "residual")
    if not _checks.kernel_supports_place(x):
        warn_fallback(OP, x.place)
        return fused_add_rms_norm_ref(x, residual, weight, epsilon)
    return _AddRMSNorm.apply(_checks.contiguous(x), _checks.contiguous(residual), weight,
                             float(epsilon))


def rms_norm_ref(x: paddle.Tensor, weight: paddle.Tensor, epsilon: float = 1e-6) -> paddle.Tensor:
    """PaddleNLP LlamaRMSNorm.forward, with the final multiply in fp32 because Paddle CPU has no
    half-precision multiply-broadcast gradient; the result is cast to the weight dtype."""
    compute = paddle.float64 if x.dtype == paddle.float64 else paddle.float32
    hidden = x.astype(compute)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = paddle.rsqrt(variance + epsilon) * hidden
    if weight.dtype in (paddle.float16, paddle.bfloat16):
        hidden = hidden.astype(weight.dtype).astype(compute)  # PaddleNLP's cast before the weight
    return (hidden * weight.astype(compute)).astype(weight.dtype)


def fused_add_rms_norm_ref(x, residual, weight, epsilon: float = 1e-6):
    compute = paddle.float64 if x.dtype == paddle.float64 else paddle.float32
    total = (x.astype(compute) + residual.astype(compute)).astype(x.dtype)
    return rms_norm_ref(total, weight, epsilon), total
