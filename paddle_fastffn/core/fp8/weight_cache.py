"""FP8 copies of weights, quantised once per weight version: forward and dgrad (and every
micro-batch of a gradient-accumulation step) reuse a copy until its weight changes.

Freshness is explicit. A weight's version is the pair

    (its explicit version: weights_changed() bumps it,  the framework's own signals)

  explicit: what updates a weight without the framework noticing bumps it. Paddle 3.3.1's
      optimizer kernels, Tensor.set_value, copy_ and Layer.set_state_dict leave a tensor's
      inplace version as it was (tests/fp8/test_weight_cache.py pins that), so the updaters say it
      themselves: paddle_fastffn.optim.FastAdamW's step, a stock optimizer through its instance
      hook (paddle_fastffn.fp8.track_optimizer; the Trainer integration installs it), the LLaMA
      checkpoint load, and paddle_fastffn.fp8.weights_updated(model) for hand-written loops (as
      Transformer Engine's is_first_microbatch). torch bumps `_version` on every in-place write,
      optimizer steps included, so its signals alone see every update.
  signals (the backend's weight_signals): the framework's inplace version (in-place ops such as
      assign(output=...), p[...] = v), the data pointer (a parameter given another buffer), dtype
      and shape.

Frozen weights (LoRA's base) are bumped by nothing but a load or a hand call: they are quantised
once for the whole run. Nothing here is process-wide beyond the version table, which holds the
weights weakly.
"""

from __future__ import annotations

import weakref

# id(weight) -> [weak reference to it, how many explicit updates it has seen]. Keyed by identity,
# not by the tensor (a WeakKeyDictionary compares keys with ==, which frameworks make elementwise);
# a freed weight's entry leaves with it.
_EXPLICIT_VERSIONS: dict[int, list] = {}


def _forget(key: int, ref) -> None:
    entry = _EXPLICIT_VERSIONS.get(key)
    if entry is not None and entry[0] is ref:
        del _EXPLICIT_VERSIONS[key]


def weights_changed(weights) -> None:
    """Record that each weight in `weights` (an iterable of tensors) may hold new values: FP8
    copies cached for them are re-made at their next use."""
    for weight in weights:
        key = id(weight)
        entry = _EXPLICIT_VERSIONS.get(key)
        if entry is not None and entry[0]() is weight:
            entry[1] += 1
        else:
            _EXPLICIT_VERSIONS[key] = [weakref.ref(weight, lambda ref, key=key: _forget(key, ref)), 1]


def updated_parameters(params_grads) -> list:
    """The parameters an optimizer's update over `params_grads` changes: those with a gradient
    (params_grads: [(param, grad)], or a parameter group {"params": [(param, grad)], ...}, as
    Paddle's Optimizer._apply_optimize receives them)."""
    pairs = params_grads["params"] if isinstance(params_grads, dict) else params_grads
    return [param for param, grad in pairs if grad is not None]


def explicit_version(weight) -> int:
    entry = _EXPLICIT_VERSIONS.get(id(weight))
    return entry[1] if entry is not None and entry[0]() is weight else 0


class WeightCache:
    """FP8 copies of weights, each re-made only when the weight's version changes (module
    docstring). `weight_signals(weight)` is the backend's tuple of the framework's own change
    signals. `quantizations` counts the quantisations done (tests and benchmarks read it)."""

    def __init__(self, weight_signals):
        self._weight_signals = weight_signals
        self._entries: dict[int, tuple] = {}
        self.quantizations = 0

    def version(self, weight) -> tuple:
        return (explicit_version(weight), *self._weight_signals(weight))

    def get(self, weight, state, quantize):
        """The FP8 copy of `weight` for its current version; `quantize(weight, state)` makes it
        (recording the weight's amax in its scaling state `state`). A copy made by another
        `quantize` (another backend, or other layouts) is not reused."""
        version = (self.version(weight), quantize)
        entry = self._entries.get(id(weight))
        if entry is not None and entry[0] is weight and entry[1] == version:
            return entry[2]
        quantized = quantize(weight, state)
        self._entries[id(weight)] = (weight, version, quantized)
        self.quantizations += 1
        return quantized

    def cached(self):
        """The FP8 copies held now (tests)."""
        return [entry[2] for entry in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()
