"""The optimizer part of a training step, written once: what Paddle's FastAdamW
(paddle_fastffn/optim/adamw.py) and the GPU harness's FusedMasterAdamW (paddle_fastffn/torch/llama.py)
both execute (the trace of one training step must be the same on both sides).

One step, in order:
1. the global-norm clip coefficient (`clip_coefficient`), as paddle.nn.ClipGradByGlobalNorm computes
   it in dygraph on a GPU: one squared norm per clipped gradient (fp32 accumulation, the result in
   the gradient's dtype, Paddle's squared_l2_norm), stacked and summed per dtype group straight into
   the sum dtype (float64 when any gradient is float64, else float32), sqrt, then
   clip_norm / max(norm, clip_norm), all on the device: no host read, no gradient rewritten;
2. the learning rate: one device scalar the kernel reads, written only when its value changed
   (`LearningRateSlot`; with a scheduler that is once per step, with a constant rate never);
3. one AdamW kernel call per parameter with a gradient (`ParameterUpdate`): it multiplies the
   gradient by the coefficient as it reads it and, as Paddle's adamw does, advances that
   parameter's own beta powers (beta1^t, beta2^t), which live on the host: no kernel of their own.
   For a weight an FP8 layer has quantised, the same call writes the updated weight's amax where
   its next quantisation reads it (core/fp8/weight_cache.py, AmaxSlot): current scaling's amax
   pass over the weight, folded into the pass that writes it.
Releasing the gradients afterwards is the framework's (Paddle: FastAdamW.clear_grad; torch:
zero_grad sets None): both release instead of zero-filling, since the next backward writes them.

The clip differs from Paddle's own in one place, on purpose: Paddle rounds a 16-bit group's sum to
the gradients' dtype and casts it (a sum and a cast); here the one sum writes the sum dtype
directly (more accurate, one op less). With one dtype group Paddle also stacks and sums the one
group total again; here that total is the sum.

Nothing here imports Paddle or torch; `OptimizerBackend` is what a framework supplies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from .fp8 import weight_cache

Tensor = Any

HALF, SINGLE, DOUBLE = "half", "single", "double"


class OptimizerBackend(Protocol):
    """What the optimizer step asks of a framework (each method is one framework op or kernel)."""

    def precision(self, t: Tensor) -> str:
        """HALF (float16/bfloat16), SINGLE (float32) or DOUBLE (float64): t's dtype group."""

    def squared_norm(self, grad: Tensor) -> Tensor:
        """sum(grad^2) as one reduction with fp32 accumulation: a one-element tensor in grad's dtype
        on grad's device (Paddle's squared_l2_norm; where a framework has no 16-bit kernel for it,
        as Paddle's CPU build, in the dtype it computes in: the square's dtype picks its group)."""

    def stack(self, scalars: Sequence[Tensor]) -> Tensor:
        """The one-element tensors as one [len] tensor (one concat)."""

    def sum(self, t: Tensor, dtype: str) -> Tensor:
        """sum(t) as one reduction whose result has dtype ("float32" or "float64")."""

    def sqrt(self, t: Tensor) -> Tensor: ...
    def maximum(self, a: Tensor, b: Tensor) -> Tensor: ...
    def divide(self, a: Tensor, b: Tensor) -> Tensor: ...
    def greater(self, a: Tensor, b: Tensor) -> Tensor: ...
    def where(self, condition: Tensor, a: Tensor, b: Tensor) -> Tensor: ...

    def full(self, value: float, dtype: str, like: Tensor) -> Tensor:
        """A new one-element tensor of `value` in dtype on like's device (one fill)."""

    def to_float32(self, t: Tensor) -> Tensor:
        """t as float32 (one cast; the core calls it only when t is not float32 already)."""

    def dtype_name(self, t: Tensor) -> str:
        """"float32", "float64", ... (no device work)."""

    def same_device(self, a: Tensor, b: Tensor) -> bool:
        """Whether a and b live on one device (no device work)."""

    def fill_(self, t: Tensor, value: float) -> None:
        """Writes value into the one-element tensor t (one fill, no host read)."""

    def adamw(self, update: "ParameterUpdate", learning_rate: Tensor, grad_scale: Tensor | None,
              hyper: "AdamWHyper") -> None:
        """One call of the AdamW kernel (fastffn/optimizer.h) on update's tensors, in place, with
        learning_rate and grad_scale as device scalars (grad_scale None: 1), then update's beta
        powers multiplied by beta1 / beta2 on the host, as Paddle's adamw kernel does after each
        parameter's step."""


@dataclass(frozen=True)
class GlobalNormClip:
    """paddle.nn.ClipGradByGlobalNorm's settings (and FusedMasterAdamW's max_grad_norm)."""
    clip_norm: float
    auto_skip_clip: bool = False


@dataclass(frozen=True)
class AdamWHyper:
    beta1: float
    beta2: float
    epsilon: float
    weight_decay: float


@dataclass
class ParameterUpdate:
    """One parameter's part of the step: its tensors (param, grad, the moments: fp32, or uint8 codes
    with their fp32 absmax per QUANT_BLOCK elements (8-bit moments); the fp32 master or None, the
    Kahan compensation or None; its beta powers: one-element fp32 tensors on the host), its
    lr_ratio, whether weight decay applies, and whether the global-norm clip scales its gradient
    (Paddle's param.need_clip)."""
    param: Tensor
    grad: Tensor
    moment1: Tensor
    moment2: Tensor
    master: Tensor | None
    beta1_pow: Tensor
    beta2_pow: Tensor
    lr_ratio: float = 1.0
    with_decay: bool = True
    clipped: bool = True
    compensation: Tensor | None = None
    moment1_absmax: Tensor | None = None
    moment2_absmax: Tensor | None = None
    param_amax: Tensor | None = None  # one fp32 the kernel sets to max |param| after the update


# --- Low-memory optimizer state (fastffn/optimizer.h: fastffn_adamw_with_state_*) ---------------
MOMENT_FORMATS = ("fp32", "int8")          # fp32 moments, or 8-bit blockwise-quantised ones
MASTER_WEIGHT_FORMATS = ("fp32", "compensated")  # fp32 masters, or 16-bit Kahan compensation
QUANT_BLOCK = 256  # FASTFFN_ADAMW_QUANT_BLOCK: elements per absmax
# Tensors smaller than this keep fp32 moments under "int8" (bitsandbytes' min_8bit_size): norms
# and biases are a sliver of the memory, and their few blocks would make per-block scales coarse
# for the parameters that steer every layer's scale.
MIN_8BIT_SIZE = 4096
_DECADES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)


@dataclass(frozen=True)
class StateFormat:
    """How the optimizer keeps its state: `moments` one of MOMENT_FORMATS, `master_weights` one of
    MASTER_WEIGHT_FORMATS, `min_8bit_size` the smallest tensor whose moments are quantised. A bad
    value raises ValueError naming the argument."""
    moments: str = "fp32"
    master_weights: str = "fp32"
    min_8bit_size: int = MIN_8BIT_SIZE

    def __post_init__(self):
        if self.moments not in MOMENT_FORMATS:
            raise ValueError(f"argument `moments` must be one of {list(MOMENT_FORMATS)}, got {self.moments!r}")
        if self.master_weights not in MASTER_WEIGHT_FORMATS:
            raise ValueError(f"argument `master_weights` must be one of {list(MASTER_WEIGHT_FORMATS)}, "
                             f"got {self.master_weights!r}")
        if isinstance(self.min_8bit_size, bool) or not isinstance(self.min_8bit_size, int) or self.min_8bit_size < 0:
            raise ValueError(f"argument `min_8bit_size` must be an int >= 0, got {self.min_8bit_size!r}")

    @property
    def compact(self) -> bool:
        return self.moments != "fp32" or self.master_weights != "fp32"

    def quantizes(self, numel: int) -> bool:
        """Whether a tensor of numel elements gets 8-bit moments."""
        return self.moments == "int8" and numel >= self.min_8bit_size


def absmax_blocks(numel: int) -> int:
    """How many absmax values 8-bit moments of numel elements keep."""
    return -(-numel // QUANT_BLOCK)


def dynamic_map(signed: bool) -> list[float]:
    """The 256 entries (ascending, as Python floats; the kernel rounds each to fp32) of the map the
    kernel quantises moment1 (signed) or moment2 (unsigned) with: bitsandbytes' dynamic map,
    fastffn/optimizer.h says why (adamw_math.h's dynamic_map_value evaluates the same formula)."""
    positives = []
    count = 1 if signed else 2
    for scale in _DECADES:
        positives += [scale * (0.1 + (j + 0.5) * 0.9 / count) for j in range(count)]
        count *= 2
    negatives = [-v for v in reversed(positives)] if signed else []
    return negatives + [0.0] + positives + [1.0]


def state_memory(params: Sequence[tuple[int, int]], state: StateFormat = StateFormat(),
                 multi_precision: bool = True) -> dict[str, int]:
    """Bytes the training state takes for parameters given as (numel, bytes per element): weights,
    masters (fp32 masters, or the compensation of "compensated", for 16-bit parameters with
    multi_precision), moments (both; 8-bit codes plus their fp32 absmax, or fp32), gradients (in
    the parameter's dtype, as the fused kernel reads them), and the total. Beta powers (8 bytes per
    tensor) are left out."""
    weights = masters = moments = gradients = 0
    for numel, itemsize in params:
        weights += numel * itemsize
        gradients += numel * itemsize
        if itemsize < 4 and multi_precision:
            masters += numel * (itemsize if state.master_weights == "compensated" else 4)
        moments += 2 * (numel + 4 * absmax_blocks(numel) if state.quantizes(numel) else 4 * numel)
    return {"weights": weights, "masters": masters, "moments": moments, "gradients": gradients,
            "total": weights + masters + moments + gradients}


def clip_coefficient(be: OptimizerBackend, grads: Sequence[Tensor], clip: GlobalNormClip) -> Tensor | None:
    """clip_norm / max(global_norm, clip_norm) of `grads` (the clipped gradients), a one-element
    tensor in the sum dtype on their device, or None when there is none. auto_skip_clip: 1 where
    Paddle skips the clip (global_norm <= clip_norm), decided on the device."""
    groups: dict[str, list] = {HALF: [], SINGLE: [], DOUBLE: []}
    for grad in grads:
        square = be.squared_norm(grad)
        groups[be.precision(square)].append(square)
    sum_dtype = "float64" if groups[DOUBLE] else "float32"
    parts = [be.sum(be.stack(squares), sum_dtype) for squares in groups.values() if squares]
    if not parts:
        return None
    total = parts[0] if len(parts) == 1 else be.sum(be.stack(parts), sum_dtype)
    global_norm = be.sqrt(total)
    max_norm = be.full(clip.clip_norm, sum_dtype, global_norm)
    if clip.auto_skip_clip:
        return be.where(be.greater(global_norm, max_norm), be.divide(max_norm, global_norm),
                        be.full(1.0, sum_dtype, global_norm))
    return be.divide(max_norm, be.maximum(global_norm, max_norm))


def as_grad_scale(be: OptimizerBackend, coefficient: Tensor | None) -> Tensor | None:
    """The coefficient as the kernel's fp32 grad_scale (a cast only for a float64 sum)."""
    if coefficient is None or be.dtype_name(coefficient) == "float32":
        return coefficient
    return be.to_float32(coefficient)


class LearningRateSlot:
    """The device scalar the kernel reads the learning rate from, written only when the value
    changes (Paddle writes its scheduler's value into it before every step, whether it changed or
    not: one fill kernel per step that a constant rate does not need)."""

    def __init__(self, written: float | None = None):
        self.written = written  # the value the tensor holds (None: unknown)

    def set(self, be: OptimizerBackend, tensor: Tensor, value: float) -> None:
        value = float(value)
        if value != self.written:
            be.fill_(tensor, value)
            self.written = value

    def written_elsewhere(self, value: float | None) -> None:
        """The tensor was written outside set() (created, loaded) with value (None: unknown, the
        next set() writes)."""
        self.written = None if value is None else float(value)


def update_parameters(be: OptimizerBackend, updates: Sequence[ParameterUpdate], learning_rate: Tensor,
                      grad_scale: Tensor | None, hyper: AdamWHyper) -> None:
    """Step 3: one kernel call per parameter, the clipped ones with the coefficient; a weight with
    an AmaxSlot gets its amax written there by the same call."""
    for update in updates:
        slot = weight_cache.amax_slot(update.param)
        if slot is not None and not be.same_device(slot.state.amax_history, update.param):
            slot = None  # a history elsewhere (a layer moved after its first use): the pass stays
        if slot is not None:
            update.param_amax = slot.target()
        be.adamw(update, learning_rate, grad_scale if update.clipped else None, hyper)
        if slot is not None:
            slot.written(update.param)


def adamw_step(be: OptimizerBackend, updates: Sequence[ParameterUpdate], learning_rate: Tensor,
               hyper: AdamWHyper, clip: GlobalNormClip | None = None) -> None:
    """The whole step over the parameters that have a gradient (steps 1 and 3; the caller has set
    the learning rate through its LearningRateSlot)."""
    grad_scale = None
    if clip is not None:
        grad_scale = as_grad_scale(be, clip_coefficient(be, [u.grad for u in updates if u.clipped], clip))
    update_parameters(be, updates, learning_rate, grad_scale, hyper)
