"""Quantise each weight once per optimizer step: forward and dgrad (and every micro-batch of a
gradient-accumulation step) reuse the FP8 copy until the weight changes.

How a change is seen. Paddle 3.3.1's optimizers update parameters in C++ kernels (adam_, sgd_, ...)
that do not bump the parameter's inplace version, and neither do `set_value` / `set_state_dict`
or `copy_` (tests/fp8/test_weight_cache.py pins these facts), so the version counter alone misses
every update that matters. A cached entry is therefore keyed by four cheap signals:

  1. the number of optimizer updates so far, counted by a wrapper around
     `paddle.optimizer.Optimizer._apply_optimize`, the one method through which `step()` and
     `minimize()` of every Paddle optimizer update parameters (Adam's and AdamW's own `step` too;
     fleet's hybrid-parallel and sharding optimizers and GradScaler call it on their inner one).
     Frozen parameters (stop_gradient, e.g. LoRA's base weights) ignore it: no optimizer changes
     them, so they stay cached for the whole run;
  2. the number of `Tensor.set_value` / `copy_` calls (checkpoint loads through
     set_state_dict, LoRA's merge/unmerge and PiSSA init, PaddleNLP's embedding resize);
  3. the parameter's `_inplace_version()` (in-place ops: assign(output=...), p[...] = v, fill_, add_);
  4. its `data_ptr()` (buffer swaps, e.g. PaddleNLP's faster_set_state_dict sharing a new buffer).

The counters are process-wide, so a write to any tensor re-quantises every cached weight: more
quantisations than needed if something writes tensors every step (`quantizations` shows it), never
a stale copy. A write that none of these see (a custom C++ op writing the buffer) needs
`WeightCache.clear()`.
"""

from __future__ import annotations

import functools

import paddle

from .formats import Quantized
from .recipe import ScalingState


class _UpdateCounters:
    optimizer_updates = 0
    value_writes = 0
    installed = False


# Tensor methods that overwrite a tensor's values without bumping its inplace version.
_VALUE_WRITERS = ("set_value", "copy_")


def _counted(method, counter: str):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:  # counted even when it raises half-way: some values may have changed
            setattr(_UpdateCounters, counter, getattr(_UpdateCounters, counter) + 1)

    return wrapper


def install_update_hooks() -> None:
    """Count Optimizer._apply_optimize calls and Tensor value writes (idempotent)."""
    if _UpdateCounters.installed:
        return
    optimizer_cls = paddle.optimizer.Optimizer
    optimizer_cls._apply_optimize = _counted(optimizer_cls._apply_optimize, "optimizer_updates")
    for name in _VALUE_WRITERS:
        setattr(paddle.Tensor, name, _counted(getattr(paddle.Tensor, name), "value_writes"))
    _UpdateCounters.installed = True


def weight_version(param: paddle.Tensor) -> tuple:
    """Changes whenever `param`'s values may have changed (see the module docstring)."""
    updates = None if param.stop_gradient else _UpdateCounters.optimizer_updates
    return (updates, _UpdateCounters.value_writes, param._inplace_version(), param.data_ptr(),
            param.dtype, tuple(param.shape))


class WeightCache:
    """FP8 copies of weights, each re-quantised only when its weight_version changes.
    `quantizations` counts the quantisations done (tests and benchmarks read it)."""

    def __init__(self):
        install_update_hooks()
        self._entries: dict[int, tuple[paddle.Tensor, tuple, Quantized]] = {}
        self.quantizations = 0

    def get(self, weight: paddle.Tensor, state: ScalingState, quantize=None) -> Quantized:
        """The weight's FP8 copy for its current version. `quantize(weight, state)` makes it
        (default: state.quantize, the emulated path; the CUDA backend passes its own, which keeps
        both layouts); an entry made by another `quantize` is not reused."""
        version = (*weight_version(weight), quantize)
        entry = self._entries.get(id(weight))
        if entry is not None and entry[0] is weight and entry[1] == version:
            return entry[2]
        # records the weight's amax once per version
        quantized = state.quantize(weight) if quantize is None else quantize(weight, state)
        self._entries[id(weight)] = (weight, version, quantized)
        self.quantizations += 1
        return quantized

    def clear(self) -> None:
        self._entries.clear()
