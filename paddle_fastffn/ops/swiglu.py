"""SwiGLU: ``silu(gate) * up``, fused into one pass over memory.

Stack: core op (paddle_fastffn/core/swiglu.py, over ops/_backend.py's compiled-op calls) ->
autograd (``pylayer(core op)``) -> public ``swiglu`` -> ``swiglu_ref``. Also
``swiglu_down_proj``: SwiGLU followed by the down projection with the SwiGLU output recomputed in
backward instead of stored (the backward kernel writes it beside the gradients, so recompute costs
no extra pass over memory).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from ..core import swiglu as core
from . import _checks
from ._autograd import pylayer
from ._fallback import warn_fallback

OP = "paddle_fastffn.ops.swiglu"

_SwiGLUPacked = pylayer(core.SwiGLUPacked)
_SwiGLU = pylayer(core.SwiGLU)
_SwiGLUDownProj = pylayer(core.SwiGLUDownProj)


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


def swiglu(x: paddle.Tensor, y: paddle.Tensor | None = None, reuse_input_memory: bool = False) -> paddle.Tensor:
    """``silu(x) * y``; with ``y`` None, ``x`` is ``[..., 2*I]`` holding ``[gate | up]``.

    Same semantics as ``paddle.incubate.nn.functional.swiglu``.
    x, y: [..., I] (or x: [..., 2I]) in float32/float16/bfloat16/float64 -> fp32 math -> same dtype.
    Gradients flow to both halves (or both inputs).
    reuse_input_memory (two inputs only): the backward writes x's and y's gradients over x and y.
    Only for tensors nothing else reads after this op (the unfused MLP's projection outputs); never
    for a tensor the caller keeps.
    """
    _check_swiglu_inputs(x, y)
    if not _checks.kernel_supports_place(x):
        warn_fallback(OP, x.place)
        return swiglu_ref(x, y)
    x = _checks.contiguous(x)
    if y is None:
        if reuse_input_memory:
            raise ValueError(f"{OP}: reuse_input_memory applies to two inputs (x and y); the packed "
                             f"[gate | up] form reuses its memory through swiglu_down_proj")
        return _SwiGLUPacked.apply(x)
    return _SwiGLU.apply(x, _checks.contiguous(y), bool(reuse_input_memory))


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
    # recompute: only gate_up and the weight are kept (core.SwiGLUDownProj).
    return _SwiGLUDownProj.apply(_checks.contiguous(gate_up), weight, True, bool(reuse_gate_up_memory))


def swiglu_ref(x: paddle.Tensor, y: paddle.Tensor | None = None) -> paddle.Tensor:
    """Pure-Paddle reference: fp32 math (Paddle CPU has no half silu), cast back to x.dtype."""
    if y is None:
        x, y = paddle.chunk(x, 2, axis=-1)
    compute = paddle.float64 if x.dtype == paddle.float64 else paddle.float32
    out = F.silu(x.astype(compute)) * y.astype(compute)
    return out.astype(x.dtype)
