"""One weight quantisation per optimizer step: reused by every forward and dgrad of the step,
redone after the optimizer (or anything else) changes the weight."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_fastffn.fp8 import Fp8Recipe, WeightCache, fp8_linear
from paddle_fastffn.fp8.formats import quantize_dequantize

OPTIMIZERS = {
    "sgd": lambda params: paddle.optimizer.SGD(learning_rate=0.1, parameters=params),
    "momentum": lambda params: paddle.optimizer.Momentum(learning_rate=0.1, parameters=params),
    "adam": lambda params: paddle.optimizer.Adam(learning_rate=0.1, parameters=params),
    "adamw": lambda params: paddle.optimizer.AdamW(learning_rate=0.1, parameters=params),
}


class Model:
    """One FP8 linear with its states and cache, and its optimizer."""

    def __init__(self, optimizer="adam", scaling="delayed"):
        self.linear = paddle.nn.Linear(32, 48)
        self.states = Fp8Recipe(scaling=scaling, amax_history_len=8).linear_states()
        self.cache = WeightCache()
        self.opt = OPTIMIZERS[optimizer](self.linear.parameters())

    def __call__(self, x):
        linear = self.linear
        return fp8_linear(x, linear.weight, linear.bias, states=self.states, weight_cache=self.cache)

    def forward_backward(self, rows=8):
        x = paddle.randn([rows, 32])
        x.stop_gradient = False
        loss = (self(x) ** 2).mean()
        loss.backward()
        return loss

    def step(self):
        self.opt.step()
        self.opt.clear_grad()


def cached_weight(model):
    (_, _, quantized), = model.cache._entries.values()
    return quantized


def test_paddle_updates_do_not_bump_the_inplace_version():
    """Why the cache counts optimizer updates and set_value itself (Paddle 3.3.1)."""
    linear = paddle.nn.Linear(4, 4)
    for make in OPTIMIZERS.values():
        opt = make(linear.parameters())
        linear(paddle.randn([2, 4])).sum().backward()
        opt.step()
    linear.weight.set_value(np.ones([4, 4], np.float32))
    linear.set_state_dict({"weight": paddle.zeros([4, 4]), "bias": paddle.zeros([4])})
    linear.weight.copy_(paddle.ones([4, 4]), False)
    assert linear.weight._inplace_version() == 0


def test_forwards_and_dgrads_of_one_step_quantise_once():
    model = Model()
    for _ in range(3):  # gradient accumulation: three micro-batches, one optimizer step
        model.forward_backward()
    assert model.cache.quantizations == 1
    assert float(model.states.weight.amax_history[0]) == float(model.linear.weight.abs().max())
    assert (model.states.input.amax_history.numpy() > 0).sum() == 3, "activations: every call"


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_optimizer_step_requantises(optimizer):
    model = Model(optimizer)
    for step in range(3):
        model.forward_backward()
        model.forward_backward()
        assert model.cache.quantizations == step + 1
        before = cached_weight(model).data.astype(paddle.float32).numpy()
        model.step()
    model.forward_backward()
    quantized = cached_weight(model)
    expected = quantize_dequantize(model.linear.weight, 1.0 / quantized.scale_inv, "e4m3")
    np.testing.assert_array_equal((quantized.data.astype(paddle.float32) * quantized.scale_inv).numpy(),
                                  expected.numpy())
    assert not np.array_equal(quantized.data.astype(paddle.float32).numpy(), before), "stale copy"


def test_minimize_and_grad_scaler_requantise():
    model = Model()
    loss = model.forward_backward()
    model.opt.minimize(loss)
    model.opt.clear_grad()
    model.forward_backward()
    assert model.cache.quantizations == 2
    # Disabled on CPU (Paddle warns) it passes through to optimizer.step; enabled on GPU, its
    # step and minimize end in the inner optimizer's _apply_optimize too (or skip on found_inf).
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024.0)
    x = paddle.randn([8, 32])
    scaler.scale((model(x) ** 2).mean()).backward()
    scaler.step(model.opt)
    scaler.update()
    model.opt.clear_grad()
    model.forward_backward()
    assert model.cache.quantizations == 3


def test_frozen_weights_stay_cached_across_steps():
    """A frozen weight (LoRA's base) is quantised once for the whole run."""
    model = Model()
    model.linear.weight.stop_gradient = True
    for _ in range(3):
        model.forward_backward()
        model.step()  # updates the bias only
    assert model.cache.quantizations == 1


def share_new_buffer(param):
    """What PaddleNLP's faster_set_state_dict does: the parameter takes another tensor's buffer."""
    new = paddle.randn(param.shape)
    param.value().get_tensor()._share_data_with(new.value().get_tensor())
    return new  # keep the buffer alive


WRITES = {
    "set_value": lambda p: p.set_value(np.ones(p.shape, np.float32)),
    "set_state_dict": lambda p: p.owner.set_state_dict({"weight": paddle.ones(p.shape),
                                                         "bias": p.owner.bias}),
    "copy_": lambda p: p.copy_(paddle.full(p.shape, 2.0), False),
    "setitem": lambda p: p.__setitem__(slice(None), 4.0),
    "assign": lambda p: paddle.assign(paddle.full(p.shape, 3.0), output=p),
    "shared_buffer": share_new_buffer,
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_writes_outside_the_optimizer_requantise(write):
    model = Model()
    model.linear.weight.stop_gradient = True  # not even the optimizer counter would help here
    model.forward_backward()
    model.linear.weight.owner = model.linear
    with paddle.no_grad():
        keep = WRITES[write](model.linear.weight)
    model.forward_backward()
    assert model.cache.quantizations == 2, write
    quantized = cached_weight(model)
    expected = quantize_dequantize(model.linear.weight, 1.0 / quantized.scale_inv, "e4m3")
    np.testing.assert_array_equal((quantized.data.astype(paddle.float32) * quantized.scale_inv).numpy(),
                                  expected.numpy())
    del keep


def test_clear():
    model = Model()
    model.forward_backward()
    model.cache.clear()
    model.forward_backward()
    assert model.cache.quantizations == 2
