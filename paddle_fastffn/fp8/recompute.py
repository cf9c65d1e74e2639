"""FP8 delayed scaling under activation recompute (PaddleNLP's `recompute`, i.e.
paddle.distributed.fleet.utils.recompute, reentrant or not).

A recomputed function runs twice per step: its forward, and again in backward to rebuild what it did
not keep. Delayed scaling must see one quantisation per tensor and step: the recompute quantises with
the scale the forward used (so it rebuilds the forward's very values) and neither records its amax
nor rolls the amax history, as Transformer Engine's activation-recompute phase does. Without this
the history advanced twice per step and the recomputed activations were quantised with the next
step's scale. Current scaling needs nothing: the same input gives the same amax and scale.

fp8_recompute(recompute) wraps a recompute function: the first run of the wrapped function is the
"forward" phase, where every delayed-scaling quantisation remembers its scale (ScalingState, in
order), and any later run the "replay" phase, which takes them back in the same order. The scales are
kept per recompute call (weakly: a forward whose backward never comes, say a step skipped after an
overflow, leaves nothing behind once its graph is freed). Tensors quantised in backward (output
gradients) are outside both phases. integration/llama.py installs the wrapper as
PaddleNLP's LLaMA `recompute` while the FP8 path is on.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import paddle

FORWARD, REPLAY = "forward", "replay"
_PHASE = threading.local()


class RecomputeCall:
    """One call of a recomputed function: what its forward's quantisations are filed under (the
    recompute keeps the wrapped function, and so this, until its backward is done)."""


def recompute_phase() -> str | None:
    """FORWARD inside the first run of a function under fp8_recompute, REPLAY inside its recompute,
    None elsewhere."""
    return getattr(_PHASE, "value", (None, None))[0]


def recompute_call() -> RecomputeCall | None:
    """The recompute call whose phase recompute_phase() names."""
    return getattr(_PHASE, "value", (None, None))[1]


@contextlib.contextmanager
def _in_phase(value: str, call: RecomputeCall):
    previous = getattr(_PHASE, "value", (None, None))
    _PHASE.value = (value, call)
    try:
        yield
    finally:
        _PHASE.value = previous


def fp8_recompute(recompute):
    """recompute(function, *args, **kwargs) with the FP8 phases of the module docstring."""
    if getattr(recompute, "fp8_phases", False):
        return recompute

    @functools.wraps(recompute)
    def recompute_with_fp8_phases(function, *args, **kwargs):
        runs, call = 0, RecomputeCall()

        def run(*run_args, **run_kwargs):
            nonlocal runs
            runs += 1
            if recompute_phase() is not None:  # nested in another recompute: part of its phases
                return function(*run_args, **run_kwargs)
            with _in_phase(FORWARD if runs == 1 else REPLAY, call):
                return function(*run_args, **run_kwargs)

        # The reentrant recompute binds the arguments to the function's signature (a Layer's
        # forward's), so the wrapper shows that signature.
        target = function.forward if isinstance(function, paddle.nn.Layer) else function
        run.__signature__ = inspect.signature(target)
        return recompute(run, *args, **kwargs)

    recompute_with_fp8_phases.fp8_phases = True
    return recompute_with_fp8_phases
