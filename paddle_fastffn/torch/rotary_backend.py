"""torch's backend for the rotary ops (paddle_fastffn/core/rotary.py), over the C API's ctypes
kernels (c_api.py): the methods core/backend.py documents under "allocation and addressing" and
"kernels" for them, plus `shape`/`contiguous`; their autograd is backend.py's one adapter. (Kept
apart from TorchBackend as the Paddle side keeps its rotary backend apart: `empty` takes a tensor's
dtype.)
"""

from __future__ import annotations

import torch

from paddle_fastffn.torch import backend as torch_backend
from paddle_fastffn.torch import c_api


class RotaryTorchBackend:
    name = "torch"

    @staticmethod
    def _kernels():
        return c_api.kernels()

    def shape(self, t):
        return tuple(t.shape)

    def contiguous(self, t):
        return t.contiguous()

    def empty(self, shape, like):
        return self._kernels().empty(tuple(shape), like.dtype, like.device)

    def is_cpu(self, t) -> bool:
        return not t.is_cuda

    def token_stride(self, t) -> int:
        """A token-strided view (q or k sliced from a fused projection) is passed as it is."""
        b, s, h, d = t.shape
        if t.stride(3) != 1 or t.stride(2) != d or t.stride(0) != t.stride(1) * s:
            raise ValueError(f"token_stride: a [b, s, heads, head_dim] tensor with dense heads was "
                             f"expected, got strides {t.stride()}")
        return t.stride(1)

    def position_flag(self, like):
        return torch.zeros(1, dtype=torch.int32, device=like.device)

    def read_flag(self, flag) -> int:
        return int(flag.item())

    def rotary(self, sources, outputs, dims, layouts, cos, sin, position_ids, position_error,
               inverse):
        self._kernels().rotary(sources, outputs, dims, layouts, cos, sin, position_ids,
                               position_error, inverse)


BACKEND = RotaryTorchBackend()


def function(op):
    """backend.py's one autograd.Function adapter, over this rotary backend."""
    return torch_backend.function(op, BACKEND)
