"""Paddle's autograd adapter for the core layer's fused ops (core/autograd.py), private to the FP8
package until the lead folds it into paddle_fastffn/ops/_autograd.py (branch i20-core-ops), whose
`pylayer(op)` keeps the same semantics: `needs` from stop_gradient, recorded in forward; the saved
tensors through ctx.save_for_backward (None entries keep their positions); None gradients for the
options. Here the backend is a parameter: the FP8 ops run over the emulated or the CUDA backend."""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from ..core.autograd import Saved


def pylayer(op, backend):
    """A PyLayer running `op` (a core FusedOp) over `backend`; apply(*inputs, *options)."""
    count = len(op.inputs)

    def forward(ctx, *args):
        tensors = args[:count]
        is_tensor = [isinstance(t, paddle.Tensor) for t in tensors]
        saved = Saved([tensor and not t.stop_gradient for t, tensor in zip(tensors, is_tensor)])
        outputs = op.forward(backend, saved, *args)
        kept = [i for i, t in enumerate(saved.tensors) if t is not None]
        ctx.save_for_backward(*(saved.tensors[i] for i in kept))
        ctx.layout = (len(saved.tensors), kept, is_tensor)
        saved.tensors = ()  # only the framework's copies reach backward
        ctx.fused_saved = saved
        return outputs

    def backward(ctx, *output_grads):
        length, kept, is_tensor = ctx.layout
        stored = ctx.saved_tensor() if kept else ()
        tensors = [None] * length
        for i, t in zip(kept, stored if isinstance(stored, (list, tuple)) else (stored,)):
            tensors[i] = t
        saved = ctx.fused_saved
        saved.tensors = tuple(tensors)
        grads = op.backward(backend, saved, *output_grads)
        grads = grads if isinstance(grads, tuple) else (grads,)
        # Paddle wants one gradient per tensor input (None for one that wants none) and none for
        # the rest (absent optional tensors, options).
        return tuple(g for g, tensor in zip(grads, is_tensor) if tensor)

    return type(f"{op.__name__}_{backend.name.replace('-', '_')}", (PyLayer,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})
