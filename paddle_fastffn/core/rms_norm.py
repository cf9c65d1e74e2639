"""RMSNorm and the residual add fused with it, as fused ops over a Backend (the contract:
autograd.py), with PaddleNLP LlamaRMSNorm numerics (the kernels'). Paddle runs them as
ops.rms_norm / ops.fused_add_rms_norm, the torch binding as paddle_fastffn.torch.ops.RMSNorm / AddRMSNorm."""

from __future__ import annotations

from .autograd import FusedOp


class RMSNorm(FusedOp):
    """x [..., H], weight [H] -> x / sqrt(mean(x^2) + epsilon) * weight; keeps x, weight and the
    fp32 per-row rstd for backward."""

    inputs = ("x", "weight")
    options = ("epsilon",)

    @staticmethod
    def forward(be, saved, x, weight, epsilon):
        out, _, rstd = be.rms_norm(x, weight, epsilon)
        saved.save(x, weight, rstd)
        saved.epsilon = epsilon
        return out

    @staticmethod
    def backward(be, saved, d_out):
        x, weight, rstd = saved.tensors
        d_x, d_weight = be.rms_norm_grad(x, weight, rstd, be.contiguous(d_out), saved.epsilon)
        return saved.only_needed(d_x, d_weight)


class AddRMSNorm(FusedOp):
    """(rms_norm(x + residual), x + residual) in one pass; keeps the sum (not x and residual),
    weight and rstd for backward."""

    inputs = ("x", "residual", "weight")
    options = ("epsilon",)

    @staticmethod
    def forward(be, saved, x, residual, weight, epsilon):
        out, total, rstd = be.rms_norm(x, weight, epsilon, residual)
        saved.save(total, weight, rstd)
        saved.epsilon = epsilon
        return out, total

    @staticmethod
    def backward(be, saved, d_out, d_total):
        total, weight, rstd = saved.tensors
        d_total = None if d_total is None else be.contiguous(d_total)
        d_x, d_weight = be.rms_norm_grad(total, weight, rstd, be.contiguous(d_out), saved.epsilon, d_total)
        # d(x + residual)/dx = d/dresidual = identity: both inputs receive the same gradient.
        return saved.only_needed(d_x, d_x, d_weight)
