"""The phases of FP8 delayed scaling under activation recompute, framework-neutral: which run of a
recomputed function a quantisation belongs to (paddle_fastffn/fp8/recompute.py wraps Paddle's
recompute with them and says why; ScalingState in scaling.py files and takes back the forward's
scales by them). Outside any wrapped recompute (the torch harness, code without recompute) the
phase is None and nothing is filed."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

FORWARD, REPLAY = "forward", "replay"
_STATE = threading.local()


class RecomputeCall:
    """One call of a recomputed function: what its forward's scales are filed under (the recompute
    keeps the wrapped function, and so this, until its backward is done)."""


@dataclass(frozen=True)
class Phase:
    """name: FORWARD or REPLAY; replaying: the call whose scales a replay takes; recorders: the
    calls that file the scales used (a forward's, and nested recomputes' first runs)."""

    name: str
    replaying: RecomputeCall | None
    recorders: tuple


def current_phase() -> Phase | None:
    return getattr(_STATE, "phase", None)


def recompute_phase() -> str | None:
    """FORWARD inside the first run of a function under fp8_recompute, REPLAY inside its recompute,
    None elsewhere."""
    phase = getattr(_STATE, "phase", None)  # current_phase(), inline: asked several times a quantisation
    return None if phase is None else phase.name


@contextlib.contextmanager
def in_phase(phase: Phase):
    previous = current_phase()
    _STATE.phase = phase
    try:
        yield
    finally:
        _STATE.phase = previous


def phase_of_run(call: RecomputeCall, run_index: int) -> Phase:
    outer = current_phase()
    if run_index > 1:  # the call's own replay
        return Phase(REPLAY, call, ())
    if outer is None:
        return Phase(FORWARD, None, (call,))
    return Phase(outer.name, outer.replaying, outer.recorders + (call,))  # nested: the outer's phase
