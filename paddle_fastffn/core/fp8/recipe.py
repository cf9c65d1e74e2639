"""FP8 recipes (framework-neutral) with Transformer Engine's per-tensor semantics, and the scaling state they drive.

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
      layers: FP8 delayed losses 11.18 / 11.17 / 11.15 over the first three steps where bf16 gave
      11.17 / 10.88 / 10.05 and FP8 current 11.18 / 10.91 / 10.12; benchmarks/results/run9/step.json
      at commit 8c5140e).

A tensor role (a linear layer's input, weight, grad_output) has one ScalingState. Formats follow
TE's HYBRID default: e4m3 (more precision) forward, e5m2 (more range) for gradients.

Weights use current scaling under both recipes (TE's DelayedScaling delays them too): a weight is
quantised once per weight version (weight_cache.py), so its own amax costs one reduction per step,
shared by all micro-batches; and a delayed scale would pin a frozen weight (LoRA's base), which is
quantised once for the whole run, to the initial scale of 1, under which e4m3 flushes every weight
below 2^-10 to zero.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .formats import FP8_MAX, check_format  # noqa: F401  (part of the recipe's API)

SCALING_MODES = ("current", "delayed")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
SAVED_GATE_UP = ("fp8", "activation")
FROZEN_WEIGHTS = ("fp8", "fp8_both", "resident")
WEIGHT_COPIES = ("per_use", "cached")
LM_HEAD_PRECISIONS = ("bf16", "fp8")
FP8_FORMATS = ("e4m3", "e5m2")
# A scale that overflows fp32 (amax below ~1e-36) is clamped to the largest finite fp32, as TE's
# current-scaling kernel does (recipe_common.cuh, value_for_inf); otherwise 0 * Inf makes zeros NaN.
FP32_MAX = float(np.finfo(np.float32).max)
# cuBLASLt's fast accumulation (no periodic fp32 promotion) for the forward GEMMs only, as
# Transformer Engine does; dgrad and wgrad accumulate with promotion.
FAST_ACCUM_FORWARD = True


def scale_numerator(fmt_max: float, margin: float) -> float:
    """fmt_max * 2^-margin, rounded to fp32 as the kernels form it: the numerator of every scale."""
    return float(np.float32(fmt_max) * np.float32(2.0) ** np.float32(-margin))


def scaled_max(fmt: str, margin: float) -> float:
    return scale_numerator(FP8_MAX[check_format(fmt)], margin)


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
    # Frozen weights (LoRA's base): "fp8" holds each only as the FP8 copy its forward GEMM reads (1
    # byte a parameter on the device, transposed for the input-gradient GEMM in each backward; the
    # 16-bit weight moves to host memory, where merging, saving and reverting read it); "fp8_both"
    # holds both FP8 copies instead (2 bytes, the 16-bit weight's size, no transposition);
    # "resident" keeps the 16-bit weight on the device beside the cached FP8 copies (4 bytes). The
    # same quantisation each way, so the same numerics.
    frozen_weights: str = "fp8"
    # Trained weights' FP8 copies: "per_use" quantises the copy each GEMM reads when it runs (the
    # forward's in forward; the input gradient's in backward, from the weight and the forward's
    # scale, so the same bytes) and holds none, so FP8 adds no weight memory to bf16's, for one more
    # read of each weight per backward; "cached" holds both copies of each weight from its first use
    # until it changes (2 bytes a parameter more; a gradient-accumulation step then quantises each
    # weight once). Frozen weights held in 16 bits ("resident") are always cached: they never change.
    weight_copies: str = "per_use"
    # The LM head + loss (the fused linear cross-entropy's three GEMMs): "bf16", the activation
    # dtype, as Transformer Engine's and NeMo's recipes and DeepSeek-V3 keep the output head; or
    # "fp8", its GEMMs in FP8 (h and W current-scaled over the call, d_logits by its bound; d_W one
    # GEMM over every chunk: core/fp8/lm_head.py). The head is the largest GEMM left in 16 bits, and
    # grows with the vocabulary; "bf16" stays the default until the convergence harness shows "fp8"
    # within its bound.
    lm_head: str = "bf16"

    def __post_init__(self):
        _check_choice("scaling", self.scaling, SCALING_MODES)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        _check_choice("saved_gate_up", self.saved_gate_up, SAVED_GATE_UP)
        _check_choice("frozen_weights", self.frozen_weights, FROZEN_WEIGHTS)
        _check_choice("weight_copies", self.weight_copies, WEIGHT_COPIES)
        _check_choice("lm_head", self.lm_head, LM_HEAD_PRECISIONS)
        check_format(self.forward_format)
        check_format(self.backward_format)
        _check_type("amax_history_len", self.amax_history_len, int)
        _check_type("min_gemm_size", self.min_gemm_size, int)
        _check_type("first_last_bf16", self.first_last_bf16, bool)
        _check_type("delayed_warm_start", self.delayed_warm_start, bool)
        margin_is_number = isinstance(self.margin, (int, float)) and not isinstance(self.margin, bool)
        if not margin_is_number or not math.isfinite(self.margin):
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

    def caches_weight(self, trained: bool) -> bool:
        """Whether a weight's FP8 copies are kept between its uses (weight_copies; a frozen
        weight's always)."""
        return not trained or self.weight_copies == "cached"

    def layer_uses_fp8(self, layer_index: int, num_layers: int) -> bool:
        """Whether decoder layer `layer_index` (0-based, of `num_layers`) runs its GEMMs in FP8."""
        return not (self.first_last_bf16 and layer_index in (0, num_layers - 1))

    def gemm_uses_fp8(self, m: int, n: int, k: int) -> bool:
        """Whether a [m, k] x [k, n] GEMM is large enough for FP8 (see min_gemm_size)."""
        return m * n * k >= self.min_gemm_size

    def new_state(self, fmt: str, scaling: str | None = None, backend=None) -> "ScalingState":
        """A ScalingState of this recipe for one tensor role in format `fmt` (`scaling` overrides
        the recipe's: weights are "current"); its tensors are `backend`'s (default: the state
        backend the framework registered, core/fp8/backend.py)."""
        from .scaling import ScalingState

        scaling = scaling or self.scaling
        history_len = self.amax_history_len if scaling == "delayed" else 1
        return ScalingState(fmt, scaling, history_len, self.amax_compute_algo, self.margin,
                            self.delayed_warm_start, backend=backend)

    def linear_states(self, backend=None) -> "LinearScalingStates":
        from .scaling import LinearScalingStates

        return LinearScalingStates(input=self.new_state(self.forward_format, backend=backend),
                                   weight=self.new_state(self.forward_format, "current", backend),
                                   grad_output=self.new_state(self.backward_format, backend=backend))

    def lm_head_states(self, backend=None) -> "LinearScalingStates":
        """The LM head's states under lm_head "fp8": h and W in the forward format, d_logits in the
        backward format, none delayed whatever the recipe's scaling: h and W current-scaled over the
        call, d_logits scaled by its bound (core/fp8/lm_head.py)."""
        from .scaling import LinearScalingStates

        return LinearScalingStates(input=self.new_state(self.forward_format, "current", backend),
                                   weight=self.new_state(self.forward_format, "current", backend),
                                   grad_output=self.new_state(self.backward_format, "current", backend))

    def ffn_states(self, backend=None) -> "FfnScalingStates":
        from .scaling import FfnScalingStates

        forward, backward = self.forward_format, self.backward_format

        def state(fmt, scaling=None):
            return self.new_state(fmt, scaling, backend)

        return FfnScalingStates(x=state(forward), w_gate_up=state(forward, "current"),
                                w_down=state(forward, "current"), h=state(forward), dy=state(backward),
                                d_gate_up=state(backward),
                                gate_up=state(forward) if self.saved_gate_up == "fp8" else None)


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"Fp8Recipe.{name} must be one of {list(choices)}, got {value!r}")


def _check_type(name, value, kind):
    # bool is an int in Python: a history length of True is a mistake, not 1.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"Fp8Recipe.{name} must be {kind.__name__}, got {value!r}")
