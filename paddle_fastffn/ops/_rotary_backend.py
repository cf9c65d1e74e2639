"""Paddle's backend for the rotary ops (paddle_fastffn/core/rotary.py): the methods core/backend.py
documents under "allocation and addressing" and "kernels" for them, plus `shape`/`contiguous`;
their autograd is ops/_autograd.py's one PyLayer adapter. (Kept apart from PaddleBackend: its
`empty` takes the dtype from a tensor, where the other ops' passes one.)
"""

from __future__ import annotations

import paddle

from . import _autograd
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
    """ops/_autograd.py's one PyLayer adapter, over this rotary backend."""
    return _autograd.pylayer(op, BACKEND)
