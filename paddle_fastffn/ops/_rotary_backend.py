"""Paddle's side of the core layer for the rotary ops (paddle_fastffn/core/rotary.py): the backend
methods they call and the PyLayer adapter, with core/autograd.py's semantics.

Written to fold into the shared PaddleBackend (ops/_backend.py) and `pylayer` (ops/_autograd.py):
the methods below are the ones core/backend.py documents under "allocation and addressing" and
"kernels", plus `shape`/`contiguous`; `pylayer` is the contract's adapter.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from ..core.autograd import Saved
from ._loader import run_op

_NO_LAYOUT = (0, 1, 1, 1, 1)  # an absent v's slot: ignored by the kernel (with_v false)


class RotaryPaddleBackend:
    name = "paddle"

    def shape(self, t):
        return tuple(t.shape)

    def contiguous(self, t):
        return t if t.is_contiguous() else t.contiguous()

    def empty(self, shape, like):
        return paddle.empty(list(shape), dtype=like.dtype, device=like.place)

    def is_cpu(self, t) -> bool:
        return t.place.is_cpu_place()

    def token_stride(self, t) -> int:
        """Paddle's custom-op call hands a kernel its inputs contiguous (a strided view is copied
        there), so the kernel always sees heads * head_dim between tokens."""
        return t.shape[2] * t.shape[3]

    def position_flag(self, like):
        return paddle.zeros([1], dtype=paddle.int32, device=like.place)

    def read_flag(self, flag) -> int:
        return int(flag.numpy()[0])

    def rotary(self, sources, outputs, dims, layouts, cos, sin, position_ids, position_error,
               inverse):
        q, k, v = sources
        q_out, k_out, v_out = outputs
        with_v = v is not None
        flat = [int(x) for layout in layouts for x in (layout or _NO_LAYOUT)]
        # The binding's optional k/v (and k_out/v_out) slots: absent = the same tensor as q (out).
        run_op("fastffn_rotary", q, None if k is q else k, None if v is None or v is q else v,
               cos, sin, position_ids, q_out, None if k_out is q_out else k_out,
               None if v_out is None or v_out is q_out else v_out, position_error,
               [int(x) for x in dims], flat, with_v, bool(inverse))


BACKEND = RotaryPaddleBackend()


def pylayer(op):
    """A PyLayer running `op` (a core FusedOp) over the Paddle backend. Called with the op's tensor
    inputs then its options; `needs` recorded in forward from stop_gradient; saved tensors go
    through ctx.save_for_backward; backward returns one gradient per tensor argument actually
    passed (Paddle's rule: None arguments and options get none)."""
    n_inputs = len(op.inputs)

    class _Layer(PyLayer):
        @staticmethod
        def forward(ctx, *args):
            tensors = args[:n_inputs]
            saved = Saved([isinstance(t, paddle.Tensor) and not t.stop_gradient for t in tensors])
            out = op.forward(BACKEND, saved, *args)
            ctx.save_for_backward(*saved.tensors)
            saved.tensors = ()  # only the framework holds them from here
            ctx.fused_saved = saved
            ctx.tensor_positions = [i for i, t in enumerate(tensors) if isinstance(t, paddle.Tensor)]
            return out

        @staticmethod
        def backward(ctx, *output_grads):
            saved = ctx.fused_saved
            saved.tensors = tuple(ctx.saved_tensor())
            grads = op.backward(BACKEND, saved, *output_grads)
            grads = grads if isinstance(grads, tuple) else (grads,)
            picked = tuple(grads[i] for i in ctx.tensor_positions)
            return picked[0] if len(picked) == 1 else picked

    _Layer.__name__ = f"{op.__name__}PyLayer"
    return _Layer
