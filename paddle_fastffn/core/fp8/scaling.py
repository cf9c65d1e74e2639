"""The per-tensor FP8 scaling state machine (Transformer Engine's current and delayed scaling,
recipe.py's formulas), written once over an FP8 backend (backend.py): the Paddle CUDA ops, the
Paddle emulation (CPU CI) and the torch harness's ctypes kernels all run this code.

One quantisation of a tensor (quantize_with) is a kernel given as two passes: an amax-only pass
that max-accumulates the tensor's amax into amax_history[0], and a quantising pass that quantises
with `scale_used` and max-accumulates the amax into `kernel_amax`. Where the scale comes from the
tensor's own amax (current scaling; delayed scaling's warm start, recipe.py), the history is
zeroed, the amax pass runs and the backend's compute_scale sets scale and scale_inv from
history[0]; then the quantising pass. Delayed scaling ends the step (end_step: the backend's
update_amax_history takes the next scale from the history and rolls it) after every use unless
the caller ends it later (the FP8 FFN ends x's, h's and gate_up's at the end of its forward). All
of it stays on the device: no host synchronisation. Several states quantised by one kernel pass
(the SwiGLU forward writes q(h) and gate_up's copy) take their scales from their amaxes together.

Under activation recompute (recompute.py) a delayed-scaling state files the scale of each
quantisation in the forward phase and takes it back, in order, in the replay phase, which records
nothing and rolls nothing (begin_replay, scale_used, kernel_amax)."""

from __future__ import annotations

import collections
import dataclasses
import weakref
from dataclasses import dataclass

import numpy as np

from .backend import state_backend
from .formats import FP8_MAX, check_format
from .recompute import FORWARD, REPLAY, current_phase, recompute_phase


class ScalingState:
    """Per-tensor FP8 scaling of one tensor role: scale and scale_inv (fp32 [1]) and amax_history
    (fp32 [history_len]) in the layout of TE and of csrc's fastffn_fp8_update_amax_history: [0] is
    the slot of the step under way, the rest the amaxes of earlier steps, oldest first (newest at
    [-1]). Tensors of the backend that made them, updated in place (the kernels hold pointers to
    them: scale read before quantising, scale_inv written with the FP8 data, amax into [0]).
    Current scaling keeps only the last amax ([1]).

    `seeded` (host-side, no device read): whether a quantisation has recorded an amax yet. Under
    delayed scaling with warm_start, the first quantisation scales by the tensor's own amax."""

    def __init__(self, fmt: str, mode: str, history_len: int, algo: str = "max", margin: float = 0.0,
                 warm_start: bool = True, backend=None):
        self.backend = backend or state_backend()
        self.fmt, self.mode, self.algo, self.margin = check_format(fmt), mode, algo, float(margin)
        self.warm_start = warm_start
        self.seeded = False
        # Writes of amax_history by anything but the quantisations that read an amax the optimizer
        # wrote (weight_cache.AmaxSlot): amax and quantising passes, the optimizer's own writes,
        # checkpoint restores. A slot is good only while this count is the one its write left.
        self.history_writes = 0
        self.scale = self.backend.fp32_full(1, 1.0)
        self.scale_inv = self.backend.fp32_full(1, 1.0)
        self.amax_history = self.backend.fp32_full(history_len, 0.0)
        # recompute: per recompute call, the forward phase's scales, oldest first (recompute.py)
        self._forward_scales = weakref.WeakKeyDictionary()
        self._replay_scale = None  # the scale of the replayed quantisation under way
        self._replay_amax = None  # where a replayed kernel accumulates an amax nobody reads

    @property
    def fmt_max(self) -> float:
        return FP8_MAX[self.fmt]

    # --- activation recompute (recompute.py) ---------------------------------------------------
    def replaying(self) -> bool:
        """In a recompute's replay: quantise with the forward's scale, record and roll nothing."""
        return self.mode == "delayed" and recompute_phase() == REPLAY

    def begin_replay(self) -> None:
        """Takes the scale of the forward's matching quantisation (FIFO), and files it for the
        recomputes nested in this replay (recompute.py)."""
        phase = current_phase()
        scales = self._forward_scales.get(phase.replaying)
        if not scales:
            raise RuntimeError(f"paddle_fastffn.fp8: a recompute replays an FP8 quantisation ({self.fmt}, delayed "
                               "scaling) that its forward did not make; wrap the recompute function with "
                               "paddle_fastffn.fp8.recompute.fp8_recompute around the whole recomputed function")
        self._replay_scale = scales.popleft()
        self._replay_amax = self.backend.fp32_full(1, 0.0, like=self._replay_scale)
        self._file(phase, self._replay_scale)

    def remember_forward_scale(self) -> None:
        """After a quantisation in a recompute's forward phase: its scale, for the replay."""
        if self.mode == "delayed" and recompute_phase() == FORWARD:
            self._file(current_phase(), self.backend.clone(self.scale))

    def _file(self, phase, scale) -> None:
        for call in phase.recorders:
            self._forward_scales.setdefault(call, collections.deque()).append(scale)

    @property
    def scale_used(self):
        """The scale of the quantisation just made, and the one a quantising kernel reads: the
        forward's in a replay, else `scale`."""
        return self._replay_scale if self.replaying() else self.scale

    @property
    def kernel_amax(self):
        """Where a quantising kernel accumulates the amax: history ([0]), or in a replay a scratch
        scalar."""
        return self._replay_amax if self.replaying() else self.amax_history

    def scales_by_own_amax(self) -> bool:
        """Whether the next quantisation takes its scale from the tensor's own amax: always under
        current scaling; under delayed scaling, the warm start's first quantisation."""
        return self.mode == "current" or (self.warm_start and not self.seeded)

    # --- quantising ------------------------------------------------------------------------------
    def scale_from(self, x, backend=None) -> None:
        """Current scaling of a tensor quantised block by block under one scale (the FP8 LM head's h,
        a chunk of rows per quantisation): scale and scale_inv from x's amax (recorded in the
        history), x itself not quantised; each block's backend.quantize then reads `scale`."""
        if self.mode != "current":
            raise ValueError(f"ScalingState.scale_from: a {self.mode}-scaled state takes no scale from one tensor")
        be = backend or self.backend
        be.zero_(self.amax_history)
        be.quantize(x, self.scale, self.amax_history, self.fmt, rowwise=False, transpose=False)
        be.compute_scale(self.amax_history, self.scale, self.scale_inv, self.fmt_max, self.margin)

    def quantize(self, x, end_step: bool = True, backend=None, amax_recorded: bool = False, **copies):
        """x quantised under this state with `backend`'s quantize kernel (default: the state's own
        backend), its amax recorded; `copies` (rowwise, transpose, transpose_cols) say which FP8
        copies the backend writes (backend.py). amax_recorded: amax_history already holds x's amax
        (the optimizer wrote it as it wrote x: weight_cache.AmaxSlot), so the amax pass is skipped.
        Returns the backend's quantized tensor."""
        be = backend or self.backend

        def amax_pass():
            be.quantize(x, self.scale, self.amax_history, self.fmt, rowwise=False, transpose=False)

        def quantize_pass():
            return be.quantize(x, self.scale_used, self.kernel_amax, self.fmt, **copies)

        return quantize_with(be, [self], amax_pass, quantize_pass, end_step, amax_recorded)

    def end_step(self, backend=None) -> None:
        """Delayed scaling's TE amax_and_scale_update: the scale from the history's amax ("max",
        NaN entries skipped and Inf kept as TE's fmaxf reduction, or "most_recent"), then the
        history rolls ([-1] = the step that ended, the oldest leaves, [0] = 0 for the next step).
        Nothing under current scaling, nor in a recompute's replay."""
        if self.mode != "delayed" or self.replaying():
            return
        (backend or self.backend).update_amax_history(self.amax_history, self.scale, self.scale_inv,
                                                      self.algo == "most_recent", self.fmt_max, self.margin)

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        be = self.backend
        return {"scale": be.to_host(self.scale), "scale_inv": be.to_host(self.scale_inv),
                "amax_history": be.to_host(self.amax_history), "seeded": np.array(self.seeded)}

    def set_state_dict(self, state: dict):
        for name in ("scale", "scale_inv", "amax_history"):
            value = np.asarray(state[name], dtype=np.float32)
            target = getattr(self, name)
            if tuple(value.shape) != tuple(self.backend.shape(target)):
                raise ValueError(f"ScalingState.{name}: shape {list(value.shape)} != {list(self.backend.shape(target))} "
                                 f"(a different amax_history_len?)")
            self.backend.copy_from_host(target, value)
        # `seeded` is saved: a delayed state whose history rolled its only amax out (amax_history_len
        # 1 rolls it out at every step end) is seeded with an all-zero history, and must not warm-start
        # again. States saved without it: a history that holds an amax continues, an empty one warm-starts.
        self.history_writes += 1
        seeded = state.get("seeded")
        self.seeded = bool(np.asarray(state["amax_history"]).any() if seeded is None else np.asarray(seeded))

    def __repr__(self):
        return (f"ScalingState({self.fmt}, {self.mode}, scale={float(self.backend.to_host(self.scale)[0]):g}, "
                f"history_len={self.backend.shape(self.amax_history)[0]})")


def quantize_with(be, states: list, amax_pass, quantize_pass, end_step: bool = True,
                  amax_recorded: bool = False):
    """One quantisation by one kernel, given as its two passes (module docstring), of the tensors
    whose `states` it quantises. Returns quantize_pass()'s. In a recompute's replay, delayed states
    quantise with their forward's scales: no amax pass, no scale or history update. amax_recorded:
    the states' histories hold the tensors' amaxes already (ScalingState.quantize)."""
    if any(s.replaying() for s in states):
        for s in states:
            s.begin_replay()
        return quantize_pass()
    if not amax_recorded:  # the passes below write the histories
        for s in states:
            s.history_writes += 1
    own_amax = [s for s in states if s.scales_by_own_amax()]
    if own_amax:
        # The whole history: current scaling keeps one entry, and a delayed history holds no amax
        # before the warm start's first quantisation. (A delayed state beside them gets the same
        # amax max-accumulated twice, by both passes: a no-op.)
        if not amax_recorded:
            for s in own_amax:
                be.zero_(s.amax_history)
            amax_pass()
        for s in own_amax:
            be.compute_scale(s.amax_history, s.scale, s.scale_inv, s.fmt_max, s.margin)
    outputs = quantize_pass()
    for s in states:
        s.seeded = True
        s.remember_forward_scale()
        if end_step:
            s.end_step(be)
    return outputs


class _RoleStates:
    """One ScalingState per field (tensor role), saved and restored together; a field that is None
    is a role this configuration does not quantise."""

    def roles(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)

    def state_dict(self) -> dict:
        return {role: getattr(self, role).state_dict() for role in self.roles()}

    def set_state_dict(self, state: dict):
        """Restores every role `state` holds. A role it lacks stays fresh (it warm-starts): a state
        saved before gate_up's FP8 copy existed, or with Fp8Recipe.saved_gate_up "activation"."""
        for role in self.roles():
            if role in state:
                getattr(self, role).set_state_dict(state[role])


@dataclass
class LinearScalingStates(_RoleStates):
    """The three scaled tensors of one linear layer's forward and backward GEMMs."""

    input: ScalingState
    weight: ScalingState
    grad_output: ScalingState


@dataclass
class FfnScalingStates(_RoleStates):
    """The scaled tensors of the FP8 FFN (core/fp8/ffn.py): its input x, the two weights (current
    scaling under both recipes), the SwiGLU output h, the output gradient dy, d_gate_up, and
    gate_up's saved copy (None when Fp8Recipe.saved_gate_up keeps it in the activation dtype)."""

    x: ScalingState
    w_gate_up: ScalingState
    w_down: ScalingState
    h: ScalingState
    dy: ScalingState
    d_gate_up: ScalingState
    gate_up: ScalingState | None = None
