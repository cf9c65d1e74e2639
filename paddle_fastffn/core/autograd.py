"""The contract every fused op of the core layer keeps, and the one object it saves for backward.

A fused op is a class with two static methods and two names lists, written once over a backend:

    class SwiGLUDownProj(FusedOp):
        inputs = ("gate_up", "weight")          # tensor inputs, in call order (grads come back so)
        options = ("recompute", "reuse_gate_up_memory")  # non-tensor arguments after them, in order

        @staticmethod
        def forward(be, saved, gate_up, weight, recompute, reuse_gate_up_memory): ...
            # runs kernels and GEMMs through `be`; saved.save(...) what backward reads (tensors),
            # saved.<name> = ... for anything else; returns one tensor or a tuple of tensors.

        @staticmethod
        def backward(be, saved, *output_grads): ...
            # saved.tensors holds what forward saved; saved.needs[i] says whether inputs[i] wants a
            # gradient (recorded in forward, see Saved); returns one gradient per input, None where
            # not needed.

Each framework adapts the same class to its autograd once (Paddle: ops/_autograd.py `pylayer(op)`;
torch: paddle_fastffn/torch/backend.py `function(op)`): the adapter builds the backend, fills
`needs`, routes saved tensors through the framework's own saving (so recompute, hooks and memory
accounting see them; run_forward / run_backward below are that shared part), and returns None for
options. Orchestration (what is allocated, which kernels
run, in which order, what is kept) lives only in the op class.
"""

from __future__ import annotations


class Saved:
    """What one call of a fused op keeps from forward to backward.

    needs: per tensor input, whether it wants a gradient. Recorded in forward by the adapter and
    never read off saved tensors: under Paddle's non-reentrant recompute (PaddleNLP's default) the
    backward's saved tensors are the replay's detached copies, whose stop_gradient is True even
    for a trained weight (read there, down_proj loses its gradient).
    tensors: set by save() in forward; the adapter replaces them with the framework's saved copies
    before backward runs. None entries are allowed (the adapter keeps their positions)."""

    def __init__(self, needs):
        self.needs = tuple(map(bool, needs))
        self.tensors = ()

    def save(self, *tensors) -> None:
        self.tensors = tensors

    def need(self, name_or_index, inputs: tuple[str, ...] | None = None) -> bool:
        """needs[i], by index or by the input's name in `inputs`."""
        if isinstance(name_or_index, str):
            return self.needs[inputs.index(name_or_index)]
        return self.needs[name_or_index]

    def only_needed(self, *grads):
        """The gradients with None where no gradient is wanted (both frameworks require that for
        inputs that do not want one); a single gradient comes back bare."""
        out = tuple(g if need else None for g, need in zip(grads, self.needs))
        return out[0] if len(out) == 1 else out


class FusedOp:
    """Base of the core layer's fused ops (see the module docstring for the contract)."""

    inputs: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    @staticmethod
    def forward(be, saved: Saved, *args):
        raise NotImplementedError

    @staticmethod
    def backward(be, saved: Saved, *output_grads):
        raise NotImplementedError


# --- what both adapters do around an op (ops/_autograd.pylayer, torch_backend.function) ------------

def run_forward(op: type[FusedOp], be, needs, args, save_for_backward):
    """(outputs, saved): op.forward with a fresh Saved, its tensors handed to the framework's own
    saving (save_for_backward(*tensors)) so recompute, hooks and memory accounting see them. None
    entries are not handed over (Paddle's saving refuses them); their positions are kept."""
    saved = Saved(needs)
    outputs = op.forward(be, saved, *args)
    tensors = saved.tensors
    kept = [i for i, t in enumerate(tensors) if t is not None]
    save_for_backward(*[tensors[i] for i in kept])
    saved.layout = (len(tensors), kept)
    saved.tensors = ()
    return outputs, saved


def run_backward(op: type[FusedOp], be, saved: Saved, framework_saved, output_grads) -> tuple:
    """op.backward on the framework's saved copies (back in their places, None where forward saved
    None); one gradient per op input, as a tuple."""
    length, kept = saved.layout
    if not isinstance(framework_saved, (list, tuple)):  # Paddle gives one saved tensor bare
        framework_saved = (framework_saved,)
    tensors = [None] * length
    for i, t in zip(kept, framework_saved):
        tensors[i] = t
    saved.tensors = tuple(tensors)
    grads = op.backward(be, saved, *output_grads)
    saved.tensors = ()
    return grads if isinstance(grads, tuple) else (grads,)
