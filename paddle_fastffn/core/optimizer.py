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
    """One parameter's part of the step: its tensors (param, grad, fp32 moments, the fp32 master or
    None, its beta powers: one-element fp32 tensors on the host), its lr_ratio, whether weight decay
    applies, and whether the global-norm clip scales its gradient (Paddle's param.need_clip)."""
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
    """Step 3: one kernel call per parameter, the clipped ones with the coefficient."""
    for update in updates:
        be.adamw(update, learning_rate, grad_scale if update.clipped else None, hyper)


def adamw_step(be: OptimizerBackend, updates: Sequence[ParameterUpdate], learning_rate: Tensor,
               hyper: AdamWHyper, clip: GlobalNormClip | None = None) -> None:
    """The whole step over the parameters that have a gradient (steps 1 and 3; the caller has set
    the learning rate through its LearningRateSlot)."""
    grad_scale = None
    if clip is not None:
        grad_scale = as_grad_scale(be, clip_coefficient(be, [u.grad for u in updates if u.clipped], clip))
    update_parameters(be, updates, learning_rate, grad_scale, hyper)
