"""The FP8 weight cache for Paddle (paddle_fastffn/core/fp8/weight_cache.py: one quantisation per
weight version, explicit freshness) and the three ways Paddle code says a weight changed:

  track_optimizer(optimizer)  an instance hook on a stock Paddle optimizer: its parameter updates
                              (step, minimize, GradScaler's step) bump the updated parameters'
                              versions. Only that optimizer object changes: no Paddle class is
                              patched. paddle_fastffn.optim.FastAdamW bumps them itself, and the
                              Trainer integration tracks the optimizer it creates.
  weights_updated(model)      for hand-written loops and writes of any kind (set_value, copy_,
                              set_state_dict of a model the plugin did not patch, a custom op):
                              every parameter of `model` (a Layer, or an iterable of tensors)
                              is re-quantised at its next use.
  LLaMA checkpoint loads      LlamaPretrainedModel.set_state_dict under the plugin calls
                              weights_updated on the model it loaded (integration/llama.py).

Why explicit: Paddle 3.3.1's optimizers update parameters in C++ kernels (adam_, sgd_, ...) that
do not bump the parameter's inplace version, and neither do set_value, copy_ or set_state_dict
(tests/fp8/test_weight_cache.py pins these facts). The inplace version still catches in-place ops
(assign(output=...), p[...] = v, fill_), and the data pointer a parameter given another buffer
(PaddleNLP's faster_set_state_dict)."""

from __future__ import annotations

import functools

import paddle

from .emulated import EMULATED, PaddleFp8Tensors
from ..core.fp8 import weight_cache as _core

weight_signals = PaddleFp8Tensors.weight_signals


class WeightCache(_core.WeightCache):
    """core's WeightCache over Paddle's weight_signals; `quantize` defaults to the emulated path's
    (the CUDA backend passes its own, which keeps both layouts)."""

    def __init__(self):
        super().__init__(weight_signals)

    def get(self, weight: paddle.Tensor, state, quantize=None):
        return super().get(weight, state, EMULATED.quantize_weight if quantize is None else quantize)


def weights_updated(model) -> None:
    """Say that the weights of `model` (a paddle.nn.Layer, or an iterable of parameters) may have
    changed: their FP8 copies are re-made at the next forward. Needed after a write that neither
    an optimizer step nor the LLaMA checkpoint load makes (set_value, copy_, a custom op)."""
    params = model.parameters() if isinstance(model, paddle.nn.Layer) else model
    _core.weights_changed(params)


def _innermost(optimizer):
    """The optimizer that applies the updates: fleet's hybrid-parallel and sharding wrappers hold
    it as _inner_opt."""
    while getattr(optimizer, "_inner_opt", None) is not None:
        optimizer = optimizer._inner_opt
    return optimizer


def track_optimizer(optimizer):
    """Make `optimizer`'s parameter updates bump their FP8 weight versions (an instance attribute
    wrapping this object's _apply_optimize, the one method through which step() and minimize() of
    every Paddle optimizer update parameters). Idempotent; returns `optimizer`. FastAdamW needs
    none (it bumps the versions itself)."""
    from ..optim import FastAdamW

    target = _innermost(optimizer)
    if isinstance(target, FastAdamW) or getattr(vars(target).get("_apply_optimize"), "fp8_tracked", False):
        return optimizer
    apply_optimize = target._apply_optimize

    @functools.wraps(apply_optimize)
    def _apply_optimize(loss, startup_program, params_grads, *args, **kwargs):
        try:
            return apply_optimize(loss, startup_program, params_grads, *args, **kwargs)
        finally:  # bumped even when it raises half-way: some parameters may have changed
            _core.weights_changed(_core.updated_parameters(params_grads))

    _apply_optimize.fp8_tracked = True
    target._apply_optimize = _apply_optimize
    return optimizer
