"""FP8 recipes with Transformer Engine's per-tensor semantics, and the scaling state they drive.

Scale: quantised = x * scale, dequantised = q * scale_inv, and (TE's formula)

    scale = fp8_max / amax / 2^margin         kept at its previous value when amax is 0 or not finite

  current scaling: amax is this tensor's own max |x| (one extra pass over it before quantising);
  delayed scaling (TE's DelayedScaling): amax comes from a history of the last amax_history_len
      amaxes, reduced by "max" or "most_recent"; the scale used at step t comes from the history
      up to t-1, and step t's amax enters the history after it was used.
  delayed_warm_start (default on): a delayed-scaling tensor's first quantisation, whose history
      holds no amax yet, is current-scaled, and its amax seeds the history; TE's delayed rule from
      then on. Off: TE exactly, every scale starts at 1. Why: with scales of 1, the first
      backward's e5m2 gradients underflow to zero (e5m2 flushes |g * scale| below 2^-17),
      a layer fed a zero gradient records amax 0 and keeps its scale of 1, and calibration crawls
      down the layers about one tensor per step (the H200 whole-step benchmark, LLaMA-2-7B width, 8
      layers, run 9: FP8 delayed losses 11.18 / 11.17 / 11.15 over the first three steps where
      bf16 gave 11.17 / 10.88 / 10.05 and FP8 current 11.18 / 10.91 / 10.12).

A tensor role (a linear layer's input, weight, grad_output) has one ScalingState. Formats follow
TE's HYBRID default: e4m3 (more precision) forward, e5m2 (more range) for gradients.

Weights use current scaling under both recipes (TE's DelayedScaling delays them too): a weight is
quantised once per optimizer step (weight_cache.py), so its own amax costs one reduction per step,
shared by all micro-batches; and a delayed scale would pin a frozen weight (LoRA's base), which is
quantised once for the whole run, to the initial scale of 1, under which e4m3 flushes every weight
below 2^-10 to zero.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from dataclasses import dataclass

import numpy as np
import paddle

from .formats import FP8_MAX, Quantized, amax_of, check_format, quantize
from .recompute import FORWARD, REPLAY, current_phase, recompute_phase

SCALING_MODES = ("current", "delayed")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
SAVED_GATE_UP = ("fp8", "activation")
# A scale that overflows fp32 (amax below ~1e-36) is clamped to the largest finite fp32, as TE's
# current-scaling kernel does (recipe_common.cuh, value_for_inf); otherwise 0 * Inf makes zeros NaN.
_FP32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Fp8Recipe:
    scaling: str = "delayed"  # "current" | "delayed"
    forward_format: str = "e4m3"  # inputs and weights
    backward_format: str = "e5m2"  # output gradients
    amax_history_len: int = 1024  # TE's default; delayed scaling only
    amax_compute_algo: str = "max"  # "max" | "most_recent" over the history; delayed scaling only
    margin: float = 0.0  # scale = fp8_max / amax / 2^margin: headroom against growth between steps
    # Keep the first and the last decoder layer in bf16: their inputs (embeddings, the last
    # hidden states before lm_head) have the widest ranges, and FP8 recipes for LLMs (NeMo,
    # DeepSeek-V3) keep them in higher precision.
    first_last_bf16: bool = False
    # GEMMs with M * N * K below this stay bf16: quantising costs passes over the inputs that a
    # small GEMM does not earn back. 0 (every GEMM in FP8) until the H200 benchmark measures the
    # break-even size (benchmarks/gpu); that number replaces this default.
    min_gemm_size: int = 0
    # Delayed scaling: current-scale each tensor's first quantisation and seed its amax history
    # with that amax (see the module docstring); False is Transformer Engine's exact behaviour.
    delayed_warm_start: bool = True
    # What the FP8 FFN keeps of gate_up [T, 2I] for its backward (the SwiGLU recompute): "fp8",
    # its own per-tensor scaled copy in forward_format, written by the SwiGLU forward pass (1 byte
    # an element, as DeepSeek-V3 caches the SwiGLU input in FP8), or "activation", gate_up in the
    # activation dtype (2 bytes in bf16). The forward's h comes from the 16-bit gate_up either
    # way; only the backward reads the copy.
    saved_gate_up: str = "fp8"

    def __post_init__(self):
        _check_choice("scaling", self.scaling, SCALING_MODES)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        _check_choice("saved_gate_up", self.saved_gate_up, SAVED_GATE_UP)
        check_format(self.forward_format)
        check_format(self.backward_format)
        _check_type("amax_history_len", self.amax_history_len, int)
        _check_type("min_gemm_size", self.min_gemm_size, int)
        _check_type("first_last_bf16", self.first_last_bf16, bool)
        _check_type("delayed_warm_start", self.delayed_warm_start, bool)
        margin_is_number = isinstance(self.margin, (int, float)) and not isinstance(self.margin, bool)
        if not margin_is_number or not np.isfinite(self.margin):
            raise ValueError(f"Fp8Recipe.margin must be a finite number, got {self.margin!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"Fp8Recipe.amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.min_gemm_size < 0:
            raise ValueError(f"Fp8Recipe.min_gemm_size must be >= 0, got {self.min_gemm_size}")

    @classmethod
    def from_dict(cls, values: dict, prefix: str = "") -> "Fp8Recipe":
        """Build from a mapping such as TrainingArguments' fields: keys are the field names, each
        with `prefix` (e.g. "fp8_"); keys without the prefix are ignored, unknown ones with it raise."""
        fields = {f.name for f in dataclasses.fields(cls)}
        chosen = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
        unknown = sorted(set(chosen) - fields)
        if unknown:
            raise ValueError(f"unknown FP8 recipe options {[prefix + k for k in unknown]}; "
                             f"known: {sorted(prefix + f for f in fields)}")
        return cls(**chosen)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def layer_uses_fp8(self, layer_index: int, num_layers: int) -> bool:
        """Whether decoder layer `layer_index` (0-based, of `num_layers`) runs its GEMMs in FP8."""
        return not (self.first_last_bf16 and layer_index in (0, num_layers - 1))

    def gemm_uses_fp8(self, m: int, n: int, k: int) -> bool:
        """Whether a [m, k] x [k, n] GEMM is large enough for FP8 (see min_gemm_size)."""
        return m * n * k >= self.min_gemm_size

    def new_state(self, fmt: str, scaling: str | None = None) -> "ScalingState":
        scaling = scaling or self.scaling
        history_len = self.amax_history_len if scaling == "delayed" else 1
        return ScalingState(fmt, scaling, history_len, self.amax_compute_algo, self.margin,
                            self.delayed_warm_start)

    def linear_states(self) -> "LinearScalingStates":
        return LinearScalingStates(input=self.new_state(self.forward_format),
                                   weight=self.new_state(self.forward_format, scaling="current"),
                                   grad_output=self.new_state(self.backward_format))

    def ffn_states(self) -> "FfnScalingStates":
        forward, backward = self.forward_format, self.backward_format
        return FfnScalingStates(x=self.new_state(forward),
                                w_gate_up=self.new_state(forward, scaling="current"),
                                w_down=self.new_state(forward, scaling="current"),
                                h=self.new_state(forward), dy=self.new_state(backward),
                                d_gate_up=self.new_state(backward),
                                gate_up=self.new_state(forward) if self.saved_gate_up == "fp8" else None)


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"Fp8Recipe.{name} must be one of {list(choices)}, got {value!r}")


def _check_type(name, value, kind):
    # bool is an int in Python: a history length of True is a mistake, not 1.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"Fp8Recipe.{name} must be {kind.__name__}, got {value!r}")


def scale_from_amax(amax: paddle.Tensor, fmt: str, margin: float, previous: paddle.Tensor) -> paddle.Tensor:
    """fp32 [1]: fp8_max * 2^-margin / amax (fp32 division, as TE), `previous` where amax is 0 or
    not finite, clamped to the largest fp32."""
    scaled_max = float(np.float32(FP8_MAX[fmt]) * np.float32(2.0) ** np.float32(-margin))
    amax = amax.astype(paddle.float32).reshape([1])
    usable = paddle.isfinite(amax) & (amax > 0)
    safe_amax = paddle.where(usable, amax, paddle.ones_like(amax))
    scale = paddle.full([1], scaled_max, paddle.float32) / safe_amax
    scale = paddle.clip(scale, max=_FP32_MAX)
    return paddle.where(usable, scale, previous.astype(paddle.float32).reshape([1]))


class ScalingState:
    """Per-tensor FP8 scaling of one tensor role: scale and scale_inv (fp32 [1]) and amax_history
    (fp32 [history_len]) in the layout of TE and of csrc's fastffn_fp8_update_amax_history_cuda:
    [0] is the slot of the step under way, the rest the amaxes of earlier steps, oldest first
    (newest at [-1]). Updated in place, so the CUDA path can hold pointers to them across steps
    (scale: read before quantising; scale_inv: written with the FP8 data; amax: into [0]).
    Current scaling keeps only the last amax ([1]).

    `seeded` (host-side, no device read): whether a quantisation has recorded an amax yet. Under
    delayed scaling with warm_start, the first quantisation scales by the tensor's own amax.

    Under activation recompute (recompute.py) a delayed-scaling state remembers the scale of each
    quantisation in the forward phase and hands it back, in order, in the replay phase, which
    records nothing and rolls nothing (begin_replay, scale_used, kernel_amax)."""

    def __init__(self, fmt: str, mode: str, history_len: int, algo: str = "max", margin: float = 0.0,
                 warm_start: bool = True):
        self.fmt, self.mode, self.algo, self.margin = check_format(fmt), mode, algo, float(margin)
        self.warm_start = warm_start
        self.seeded = False
        self.scale = paddle.ones([1], paddle.float32)
        self.scale_inv = paddle.ones([1], paddle.float32)
        self.amax_history = paddle.zeros([history_len], paddle.float32)
        # recompute: per recompute call, the forward phase's scales, oldest first (recompute.py)
        self._forward_scales = weakref.WeakKeyDictionary()
        self._replay_scale = None  # the scale of the replayed quantisation under way
        self._replay_amax = None  # where a replayed kernel accumulates an amax nobody reads

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
        self._replay_amax = paddle.zeros_like(self._replay_scale)
        self._file(phase, self._replay_scale)

    def remember_forward_scale(self) -> None:
        """After a quantisation in a recompute's forward phase: its scale, for the replay."""
        if self.mode == "delayed" and recompute_phase() == FORWARD:
            self._file(current_phase(), self.scale.clone())

    def _file(self, phase, scale: paddle.Tensor) -> None:
        for call in phase.recorders:
            self._forward_scales.setdefault(call, collections.deque()).append(scale)

    @property
    def scale_used(self) -> paddle.Tensor:
        """The scale of the quantisation just made, and the one a CUDA quantising kernel reads: the
        forward's in a replay, else `scale`."""
        return self._replay_scale if self.replaying() else self.scale

    @property
    def kernel_amax(self) -> paddle.Tensor:
        """Where a CUDA kernel accumulates the amax: history[0], or in a replay a scratch scalar."""
        return self._replay_amax if self.replaying() else self.amax_history

    def scales_by_own_amax(self) -> bool:
        """Whether the next quantisation takes its scale from the tensor's own amax: always under
        current scaling; under delayed scaling, the warm start's first quantisation."""
        return self.mode == "current" or (self.warm_start and not self.seeded)

    def quantize(self, x: paddle.Tensor, end_step: bool = True) -> Quantized:
        """Quantise x with this role's scale and record its amax (see the module docstring).
        Delayed scaling ends the step here, after every use, as TE does after every forward;
        end_step=False leaves that to the caller (end_step()), e.g. at the end of a forward that
        still needs the scale it used."""
        with paddle.no_grad():
            if self.replaying():
                self.begin_replay()
                return quantize(x, self._replay_scale, self.fmt)
            if self.scales_by_own_amax():
                self._set_scale(scale_from_amax(amax_of(x), self.fmt, self.margin, self.scale))
            q = quantize(x, self.scale, self.fmt)  # delayed: scale from the steps before this one
            paddle.assign(q.amax, output=self.amax_history[:1])  # [0] is 0 here: the kernels max into it
            self.seeded = True
            self.remember_forward_scale()
            if end_step:
                self.end_step()
            return q

    def end_step(self):
        """Delayed scaling's TE amax_and_scale_update: the scale from the history's amax, then the
        history rolls ([-1] = the step that ended, the oldest leaves, [0] = 0 for the next step).
        Nothing under current scaling, nor in a recompute's replay."""
        if self.mode != "delayed" or self.replaying():
            return
        self._set_scale(scale_from_amax(self.history_amax(), self.fmt, self.margin, self.scale))
        history, slot = self.amax_history, paddle.zeros([1], paddle.float32)
        rolled = paddle.concat([slot, history[2:], history[:1]]) if history.shape[0] > 1 else slot
        paddle.assign(rolled, output=history)

    def history_amax(self) -> paddle.Tensor:
        """The amax the next scale comes from, over [0] and the earlier steps. "max" skips NaN
        entries and keeps Inf ones, as TE's fmaxf reduction does (an Inf in the window keeps the
        scale until it leaves the window)."""
        if self.algo == "most_recent":
            return self.amax_history[:1]
        history = self.amax_history
        return paddle.where(paddle.isnan(history), paddle.zeros_like(history), history).max().reshape([1])

    def _set_scale(self, scale: paddle.Tensor):
        paddle.assign(scale, output=self.scale)
        paddle.assign(1.0 / scale, output=self.scale_inv)

    def state_dict(self) -> dict:
        return {"scale": self.scale.numpy(), "scale_inv": self.scale_inv.numpy(),
                "amax_history": self.amax_history.numpy(), "seeded": np.array(self.seeded)}

    def set_state_dict(self, state: dict):
        for name in ("scale", "scale_inv", "amax_history"):
            value = np.asarray(state[name], dtype=np.float32)
            target = getattr(self, name)
            if list(value.shape) != list(target.shape):
                raise ValueError(f"ScalingState.{name}: shape {list(value.shape)} != {list(target.shape)} "
                                 f"(a different amax_history_len?)")
            paddle.assign(paddle.to_tensor(value), output=target)
        # `seeded` is saved: a delayed state whose history rolled its only amax out (amax_history_len
        # 1 rolls it out at every step end) is seeded with an all-zero history, and must not warm-start
        # again. States saved without it: a history that holds an amax continues, an empty one warm-starts.
        seeded = state.get("seeded")
        self.seeded = bool(np.asarray(state["amax_history"]).any() if seeded is None else np.asarray(seeded))

    def __repr__(self):
        return (f"ScalingState({self.fmt}, {self.mode}, scale={float(self.scale):g}, "
                f"history_len={self.amax_history.shape[0]})")


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
    """The scaled tensors of the FP8 FFN (fp8/ffn.py): its input x, the two weights (current
    scaling under both recipes), the SwiGLU output h, the output gradient dy, d_gate_up, and
    gate_up's saved copy (None when Fp8Recipe.saved_gate_up keeps it in the activation dtype)."""

    x: ScalingState
    w_gate_up: ScalingState
    w_down: ScalingState
    h: ScalingState
    dy: ScalingState
    d_gate_up: ScalingState
    gate_up: ScalingState | None = None
