"""RMSNorm and residual-add + RMSNorm, with PaddleNLP LlamaRMSNorm numerics.

Stack: compiled op call -> autograd (PyLayer) -> public ``rms_norm`` / ``fused_add_rms_norm``
-> ``rms_norm_ref`` / ``fused_add_rms_norm_ref``.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from . import _checks
from ._fallback import warn_fallback
from ._loader import run_op

OP = "paddle_fastffn.ops.rms_norm"


class _RMSNorm(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, epsilon):
        _checks.remember_grad_needs(ctx, x, weight)
        out, _, rstd = run_op("fastffn_rms_norm_fwd", x, None, weight, epsilon)
        ctx.save_for_backward(x, weight, rstd)
        ctx.epsilon = epsilon
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, weight, rstd = ctx.saved_tensor()
        d_x, d_weight = run_op("fastffn_rms_norm_bwd", x, weight, rstd,
                               _checks.contiguous(d_out), None, ctx.epsilon)
        return _checks.needed_grads(ctx, d_x, d_weight)


class _AddRMSNorm(PyLayer):
    @staticmethod
    def forward(ctx, x, residual, weight, epsilon):
        _checks.remember_grad_needs(ctx, x, residual, weight)
        out, total, rstd = run_op("fastffn_rms_norm_fwd", x, residual, weight, epsilon)
        ctx.save_for_backward(total, weight, rstd)
        ctx.epsilon = epsilon
        return out, total

    @staticmethod
    def backward(ctx, d_out, d_total):
        total, weight, rstd = ctx.saved_tensor()
        d_total = None if d_total is None else _checks.contiguous(d_total)
        d_x, d_weight = run_op("fastffn_rms_norm_bwd", total, weight, rstd,
                               _checks.contiguous(d_out), d_total, ctx.epsilon)
        # d(x + residual)/dx = d/dresidual = identity: both inputs receive the same gradient.
        return _checks.needed_grads(ctx, d_x, d_x, d_weight)


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
