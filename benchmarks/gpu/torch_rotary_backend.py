"""torch's side of the core layer for the rotary ops (paddle_fastffn/core/rotary.py): the backend
methods they call, over the harness's ctypes kernels, and the autograd.Function adapter, with
core/autograd.py's semantics.

Written to fold into the shared TorchBackend and `function` (benchmarks/gpu/torch_backend.py): the
methods below are the ones core/backend.py documents under "allocation and addressing" and
"kernels", plus `shape`/`contiguous`; `function` is the contract's adapter.
"""

from __future__ import annotations

import torch

from paddle_fastffn.core.autograd import Saved


class RotaryTorchBackend:
    name = "torch"

    @staticmethod
    def _kernels():
        from benchmarks.gpu import harness  # harness imports this module for its Rotary ops

        return harness.kernels()

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
    """A torch.autograd.Function running `op` (a core FusedOp) over the torch backend. apply()
    takes the op's tensor inputs then its options; `needs` from ctx.needs_input_grad (recorded in
    forward); saved tensors go through ctx.save_for_backward; backward returns None for options."""
    n_inputs = len(op.inputs)

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            saved = Saved(ctx.needs_input_grad[:n_inputs])
            out = op.forward(BACKEND, saved, *args)
            ctx.save_for_backward(*saved.tensors)
            saved.tensors = ()  # only the framework holds them from here
            ctx.fused_saved = saved
            return out

        @staticmethod
        def backward(ctx, *output_grads):
            saved = ctx.fused_saved
            saved.tensors = tuple(ctx.saved_tensors)
            grads = op.backward(BACKEND, saved, *output_grads)
            grads = grads if isinstance(grads, tuple) else (grads,)
            return grads + (None,) * len(op.options)

    _Function.__name__ = _Function.__qualname__ = f"{op.__name__}Function"
    return _Function
