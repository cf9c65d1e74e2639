"""`pylayer(op)`: Paddle's autograd for a core fused op (paddle_fastffn/core/autograd.py is the
contract), the one PyLayer adapter every op wrapper uses, so no op keeps an autograd of its own."""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from ..core.autograd import FusedOp, run_backward, run_forward
from ._backend import BACKEND


def pylayer(op: type[FusedOp], backend=BACKEND, name: str | None = None) -> type[PyLayer]:
    """A PyLayer class running `op` over `backend` (the compiled ops' PaddleBackend; FP8 passes its
    emulated or CUDA backend, rotary its own). Call it as ``cls.apply(*tensor_inputs, *options)``
    (op.inputs then op.options, all positional)."""
    n_inputs = len(op.inputs)

    class FusedPyLayer(PyLayer):
        fused_op = op

        @classmethod
        def apply(cls, *args):
            # PyLayer.forward runs with gradients off: the caller's grad mode is passed in, so an
            # op that computes gradients in forward (the fused loss) skips them under no_grad.
            return super().apply(paddle.is_grad_enabled(), *args)

        @staticmethod
        def forward(ctx, grad_enabled, *args):
            tensors = args[:n_inputs]
            # needs recorded here, never read off saved tensors in backward: under non-reentrant
            # recompute (PaddleNLP's default) ctx.saved_tensor() returns the replay's detached
            # copies, whose stop_gradient is True even for a trained weight.
            needs = [grad_enabled and t is not None and not t.stop_gradient for t in tensors]
            # Paddle wants one gradient per Tensor input: None inputs get no slot.
            ctx.tensor_inputs = tuple(t is not None for t in tensors)
            outputs, ctx.fused_saved = run_forward(op, backend, needs, args, ctx.save_for_backward)
            return outputs

        @staticmethod
        def backward(ctx, *output_grads):
            grads = run_backward(op, backend, ctx.fused_saved, ctx.saved_tensor(), output_grads)
            grads = tuple(g for g, is_tensor in zip(grads, ctx.tensor_inputs) if is_tensor)
            return grads[0] if len(grads) == 1 else grads

    FusedPyLayer.__name__ = FusedPyLayer.__qualname__ = name or op.__name__
    FusedPyLayer.__doc__ = op.__doc__
    return FusedPyLayer
