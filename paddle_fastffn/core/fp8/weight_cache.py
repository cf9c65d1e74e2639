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
once for the whole run.

The weight's amax, from the optimizer (AmaxSlot). Weights are current-scaled (recipe.py): each
quantisation of a weight (a cached copy's, or every forward's under weight_copies "per_use") is an
amax pass over the weight, then the quantising pass. The AdamW kernel writes every weight anyway,
so it can take the amax as it stores it (fastffn/optimizer.h: param_amax) for the weights an FP8
layer has quantised before: each gets one AmaxSlot, naming the ScalingState the layer quantises it
under, whose amax_history[0] the kernel writes. The slot is good for exactly the version the update
made: the optimizer marks it written, the weights_changed that follows every optimizer step
(Paddle's FastAdamW, the torch harness's FusedMasterAdamW) stamps it with the weight's new version,
and a quantisation skips its amax pass only while the weight's version is still that one and
nothing else has written the state's history since (ScalingState.history_writes: another tensor's
quantisation under a state shared by two weights, which the functional fp8_linear allows, the
kernel's write of another weight's amax, a checkpoint restore). Between two updates the history
keeps the weight's amax: the quantisations that read it max-accumulate the same value into it. Only
a current-scaled state with a one-entry history (what every FP8 layer gives its weights) takes
slots. The FP8 copy is bit for bit the one the amax pass gives, since max |x| over the same values
is exact.

What it asks of other writers: the explicit freshness rule the cached copies have always had. A write
Paddle does not report (set_value, copy_, an optimizer nobody tracked) between two FastAdamW steps
must be followed by paddle_fastffn.fp8.weights_updated(model), or the next quantisation scales the
new values by the amax of the old ones (under "cached" it would read a stale copy outright). The
plugin's own writers report theirs: FastAdamW, tracked stock optimizers, the LLaMA checkpoint load.

Nothing here is process-wide beyond the per-weight table of versions and slots, which holds the
weights weakly.
"""

from __future__ import annotations

import weakref

# id(weight) -> [weak reference to it, how many explicit updates it has seen, its AmaxSlot or
# None]. Keyed by identity, not by the tensor (a WeakKeyDictionary compares keys with ==, which
# frameworks make elementwise); a freed weight's entry leaves with it.
_WEIGHTS: dict[int, list] = {}


def _forget(key: int, ref) -> None:
    entry = _WEIGHTS.get(key)
    if entry is not None and entry[0] is ref:
        del _WEIGHTS[key]


def _entry(weight, create: bool) -> list | None:
    key = id(weight)
    entry = _WEIGHTS.get(key)
    if entry is not None and entry[0]() is weight:
        return entry
    if not create:
        return None
    entry = _WEIGHTS[key] = [weakref.ref(weight, lambda ref, key=key: _forget(key, ref)), 0, None]
    return entry


def weights_changed(weights) -> None:
    """Record that each weight in `weights` (an iterable of tensors) may hold new values: FP8
    copies cached for them are re-made at their next use. A slot the optimizer has just written
    (AmaxSlot) is stamped with the new version."""
    for weight in weights:
        entry = _entry(weight, create=True)
        entry[1] += 1
        if entry[2] is not None:
            entry[2].stamp(weight)


class AmaxSlot:
    """Where the optimizer writes one weight's amax (module docstring): the amax_history of
    `state`, the ScalingState an FP8 layer quantises the weight under; `signals` the backend's
    weight_signals. `valid_for`: what the history's amax is valid for ((the state's history_writes,
    the weight version)), or None. `pending`: (the framework's signals, history_writes) when the
    kernel wrote, until the weights_changed that follows the optimizer step stamps the version.
    Every write of the history counts, so an earlier pending or valid_for lapses by itself."""

    def __init__(self, state, signals):
        self.state, self.signals = state, signals
        self.pending = None
        self.valid_for = None

    def target(self):
        """The one-element fp32 tensor the kernel writes the amax into (a write of the history)."""
        self.state.history_writes += 1
        return self.state.amax_history

    def written(self, weight) -> None:
        self.pending = (self.signals(weight), self.state.history_writes)

    def stamp(self, weight) -> None:
        # The kernel's write must be the history's last, and of the values the weight holds now (a
        # buffer swapped in since is not them).
        if self.pending == (self.signals(weight), self.state.history_writes):
            self.valid_for = (self.state.history_writes, weight_version(weight, self.signals))
        self.pending = None

    def holds_amax_of(self, weight) -> bool:
        return self.valid_for == (self.state.history_writes, weight_version(weight, self.signals))


def amax_slot(weight) -> AmaxSlot | None:
    """The weight's AmaxSlot, or None where no FP8 layer has quantised it yet."""
    entry = _entry(weight, create=False)
    return None if entry is None else entry[2]


def _slot_for(weight, state, signals) -> AmaxSlot:
    entry = _entry(weight, create=True)
    if entry[2] is None or entry[2].state is not state:
        entry[2] = AmaxSlot(state, signals)
    return entry[2]


def optimizer_amax(weight, state, signals) -> bool:
    """Whether the quantisation of `weight` about to run may skip its amax pass: `state`'s
    amax_history holds the amax of the weight's current values, written by the optimizer's kernel
    (AmaxSlot; signals: the backend's weight_signals). The weight gets a slot for the next
    optimizer step either way, where its state can take one (current scaling, a one-entry
    history)."""
    if state.mode != "current" or state.backend.shape(state.amax_history)[0] != 1:
        return False
    return _slot_for(weight, state, signals).holds_amax_of(weight)


def weight_version(weight, signals) -> tuple:
    """(explicit version, *signals(weight)): what a cached copy and an AmaxSlot are valid for."""
    return (explicit_version(weight), *signals(weight))


def updated_parameters(params_grads) -> list:
    """The parameters an optimizer's update over `params_grads` changes: those with a gradient
    (params_grads: [(param, grad)], or a parameter group {"params": [(param, grad)], ...}, as
    Paddle's Optimizer._apply_optimize receives them)."""
    pairs = params_grads["params"] if isinstance(params_grads, dict) else params_grads
    return [param for param, grad in pairs if grad is not None]


def explicit_version(weight) -> int:
    entry = _entry(weight, create=False)
    return 0 if entry is None else entry[1]


class WeightCache:
    """FP8 copies of weights, each re-made only when the weight's version changes (module
    docstring). `weight_signals(weight)` is the backend's tuple of the framework's own change
    signals. `quantizations` counts the quantisations done, `amax_passes_skipped` those that took
    the optimizer's amax (tests and benchmarks read them)."""

    def __init__(self, weight_signals):
        self._weight_signals = weight_signals
        self._entries: dict[int, tuple] = {}
        self.quantizations = 0
        self.amax_passes_skipped = 0  # quantisations that read the optimizer's amax (AmaxSlot)

    def version(self, weight) -> tuple:
        return weight_version(weight, self._weight_signals)

    def get(self, weight, state, quantize):
        """The FP8 copy of `weight` for its current version; `quantize(weight, state,
        amax_recorded=...)` makes it (recording the weight's amax in its scaling state `state`;
        amax_recorded: the optimizer wrote this version's amax there already, AmaxSlot). A copy
        made by another `quantize` (another backend, or other layouts) is not reused."""
        version = (self.version(weight), quantize)
        entry = self._entries.get(id(weight))
        if entry is not None and entry[0] is weight and entry[1] == version:
            return entry[2]
        recorded = optimizer_amax(weight, state, self._weight_signals)
        quantized = quantize(weight, state, amax_recorded=recorded)
        self._entries[id(weight)] = (weight, version, quantized)
        self.quantizations += 1
        self.amax_passes_skipped += recorded
        return quantized

    def cached(self):
        """The FP8 copies held now (tests)."""
        return [entry[2] for entry in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()
