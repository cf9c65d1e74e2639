"""FP8 delayed scaling under activation recompute (PaddleNLP's `recompute`, i.e.
paddle.distributed.fleet.utils.recompute, reentrant or not).

A recomputed function runs twice per step: its forward, and again in backward to rebuild what it did
not keep. Delayed scaling must see one quantisation per tensor and step: the recompute quantises with
the scale the forward used (so it rebuilds the forward's very values) and neither records its amax
nor rolls the amax history, as Transformer Engine's activation-recompute phase does. Without this
the history advanced twice per step and the recomputed activations were quantised with the next
step's scale. Current scaling needs nothing: the same input gives the same amax and scale.

fp8_recompute(recompute) wraps a recompute function. The first run of the wrapped function is its
"forward" phase: every delayed-scaling quantisation files the scale it used (ScalingState, in
order) under that recompute call. A later run is its "replay" phase: the quantisations take those
scales back in the same order. The scales are kept per call, weakly: a forward whose backward never
comes (a step skipped after an overflow) leaves nothing behind once its graph is freed; a second
backward through one graph (retain_graph) finds its scales taken and raises. A recompute nested in
another one runs its first run in the outer run's phase and files what it uses under its own call
too, for its own replay. Tensors quantised in backward (output gradients) are in no phase.
integration/llama.py installs the wrapper as PaddleNLP's LLaMA `recompute` while FP8 is on.
"""

from __future__ import annotations

import functools
import inspect

import paddle

from ..core.fp8.recompute import FORWARD, REPLAY, RecomputeCall, current_phase, in_phase, phase_of_run, recompute_phase

__all__ = ["FORWARD", "REPLAY", "current_phase", "fp8_recompute", "recompute_phase"]


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
            with in_phase(phase_of_run(call, runs)):
                return function(*run_args, **run_kwargs)

        # The reentrant recompute binds the arguments to the function's signature (a Layer's
        # forward's), so the wrapper shows that signature.
        target = function.forward if isinstance(function, paddle.nn.Layer) else function
        run.__signature__ = inspect.signature(target)
        return recompute(run, *args, **kwargs)

    recompute_with_fp8_phases.fp8_phases = True
    return recompute_with_fp8_phases
