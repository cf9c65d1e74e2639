"""SwiGLU: ``silu(gate) * up``, fused into one pass over memory.

Stack: compiled op call -> autograd (PyLayer) -> public ``swiglu`` -> ``swiglu_ref``. Also
``swiglu_down_proj``: SwiGLU followed by the down projection with the SwiGLU output recomputed in
backward instead of stored (the backward kernel writes it beside the gradients, so recompute costs
no extra pass over memory).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from . import _checks
from ._fallback import warn_fallback
from ._loader import run_op

OP = "paddle_fastffn.ops.swiglu"


def _swiglu_fwd(x, y):
    return run_op("fastffn_swiglu_fwd", x, y)[0]


def _swiglu_bwd(x, y, d_out, with_recompute: bool):
    """Returns (d_x, d_y or None, recomputed forward output or None)."""
    d_x, d_y, recomputed = run_op("fastffn_swiglu_bwd", x, y, d_out, with_recompute)
    return d_x, (d_y if y is not None else None), (recomputed if with_recompute else None)


class _SwiGLUPacked(PyLayer):
    @staticmethod
    def forward(ctx, x):
        _checks.remember_grad_needs(ctx, x)
        ctx.save_for_backward(x)
        return _swiglu_fwd(x, None)

    @staticmethod
    def backward(ctx, d_out):
        (x,) = ctx.saved_tensor()
        return _checks.needed_grads(ctx, _swiglu_bwd(x, None, _checks.contiguous(d_out), False)[0])


class _SwiGLUPair(PyLayer):
    @staticmethod
    def forward(ctx, x, y):
        _checks.remember_grad_needs(ctx, x, y)
        ctx.save_for_backward(x, y)
        return _swiglu_fwd(x, y)

    @staticmethod
    def backward(ctx, d_out):
        x, y = ctx.saved_tensor()
        d_x, d_y, _ = _swiglu_bwd(x, y, _checks.contiguous(d_out), False)
        return _checks.needed_grads(ctx, d_x, d_y)


def _check_swiglu_inputs(x, y):
    _checks.check_float(x, OP, "x")
    if len(x.shape) == 0:
        raise ValueError(f"{OP}: argument `x` must have at least one dimension")
    if y is None:
        if x.shape[-1] % 2 != 0:
            raise ValueError(f"{OP}: with `y` None, `x` packs [gate | up] on its last axis, which must "
                             f"be even; got shape {list(x.shape)}")
    else:
        _checks.check_like(x, "x", y, OP, "y")


def swiglu(x: paddle.Tensor, y: paddle.Tensor | None = None) -> paddle.Tensor:
    """``silu(x) * y``; with ``y`` None, ``x`` is ``[..., 2*I]`` holding ``[gate | up]``.

    Same semantics as ``paddle.incubate.nn.functional.swiglu``.
    x, y: [..., I] (or x: [..., 2I]) in float32/float16/bfloat16/float64 -> fp32 math -> same dtype.
    Gradients flow to both halves (or both inputs).
    """
    _check_swiglu_inputs(x, y)
    if not _checks.kernel_supports_place(x):
        warn_fallback(OP, x.place)
        return swiglu_ref(x, y)
    x = _checks.contiguous(x)
    if y is None:
        return _SwiGLUPacked.apply(x)
    return _SwiGLUPair.apply(x, _checks.contiguous(y))


class _SwiGLUDownProj(PyLayer):
    """out = swiglu(gate_up) @ weight, keeping only gate_up (and weight) for backward; the
    backward overwrites gate_up with its gradient (the same composition as the GPU harness's
    FusedFFN)."""

    @staticmethod
    def forward(ctx, gate_up, weight, reuse_gate_up_memory):
        hidden = _swiglu_fwd(gate_up, None)
        _checks.remember_grad_needs(ctx, gate_up, weight)
        ctx.save_for_backward(gate_up, weight)
        ctx.reuse_gate_up_memory = reuse_gate_up_memory
        return paddle.matmul(hidden, weight)

    @staticmethod
    def backward(ctx, d_out):
        gate_up, weight = ctx.saved_tensor()
        d_hidden = _checks.contiguous(paddle.matmul(d_out, weight, transpose_y=True))
        if ctx.reuse_gate_up_memory:
            # gate_up's memory becomes d_gate_up and d_hidden's the recomputed SwiGLU output, so
            # the backward allocates no [tokens, 3I] of its own (detach: same memory, no autograd
            # in-place bookkeeping for tensors only this node holds).
            d_gate_up, hidden = gate_up.detach(), d_hidden.detach()
            run_op("fastffn_swiglu_bwd_inplace", d_gate_up, hidden)
        else:
            d_gate_up, _, hidden = _swiglu_bwd(gate_up, None, d_hidden, True)
        d_weight = None
        if _checks.grad_needed(ctx, 1):  # not weight.stop_gradient: a recompute replay's copy is detached
            d_weight = paddle.matmul(hidden.reshape([-1, weight.shape[0]]),
                                     d_out.reshape([-1, weight.shape[1]]), transpose_x=True)
        return _checks.needed_grads(ctx, d_gate_up, d_weight)


def swiglu_down_proj(gate_up: paddle.Tensor, weight: paddle.Tensor,
                     reuse_gate_up_memory: bool = False) -> paddle.Tensor:
    """``swiglu(gate_up) @ weight`` with the SwiGLU output recomputed in backward.

    gate_up: [..., 2I] packed [gate | up]; weight: [I, H] (Paddle's Linear layout) -> [..., H].
    Saves [tokens, I] activations per layer against storing the SwiGLU output; the backward kernel
    rewrites that output in the same pass that computes the gradient.
    reuse_gate_up_memory: the backward writes gate_up's gradient over gate_up itself. Only for a
    gate_up nothing else reads after this op (the fused MLP's projection output); never for a
    tensor the caller keeps.
    """
    _check_swiglu_inputs(gate_up, None)
    _checks.check_float(weight, OP, "weight")
    if len(weight.shape) != 2 or weight.shape[0] * 2 != gate_up.shape[-1]:
        raise ValueError(f"{OP}: `weight` must be [I, H] with I = gate_up.shape[-1] / 2 = "
                         f"{gate_up.shape[-1] // 2}; got {list(weight.shape)}")
    if not _checks.kernel_supports_place(gate_up):
        warn_fallback(OP, gate_up.place)
        return paddle.matmul(swiglu_ref(gate_up), weight)
    return _SwiGLUDownProj.apply(_checks.contiguous(gate_up), weight, bool(reuse_gate_up_memory))


def swiglu_ref(x: paddle.Tensor, y: paddle.Tensor | None = None) -> paddle.Tensor:
    """Pure-Paddle reference: fp32 math (Paddle CPU has no half silu), cast back to x.dtype."""
    if y is None:
        x, y = paddle.chunk(x, 2, axis=-1)
    compute = paddle.float64 if x.dtype == paddle.float64 else paddle.float32
    out = F.silu(x.astype(compute)) * y.astype(compute)
    return out.astype(x.dtype)
