"""One weight quantisation per weight version: reused by every forward and dgrad of a step, redone
after the optimizer (stock through its instance hook, FastAdamW by itself), a checkpoint load or a
hand write followed by weights_updated changes the weight; no Paddle class is patched for it."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_fastffn.fp8 import Fp8Recipe, LinearScalingStates, WeightCache, fp8_linear, track_optimizer, weights_updated
from paddle_fastffn.fp8.formats import quantize_dequantize
from paddle_fastffn.optim import FastAdamW

STOCK_OPTIMIZERS = {
    "sgd": lambda params: paddle.optimizer.SGD(learning_rate=0.1, parameters=params),
    "momentum": lambda params: paddle.optimizer.Momentum(learning_rate=0.1, parameters=params),
    "adam": lambda params: paddle.optimizer.Adam(learning_rate=0.1, parameters=params),
    "adamw": lambda params: paddle.optimizer.AdamW(learning_rate=0.1, parameters=params),
}
# Stock optimizers through their instance hook; FastAdamW untracked (it bumps the versions itself).
OPTIMIZERS = {name: (lambda make: lambda params: track_optimizer(make(params)))(make)
              for name, make in STOCK_OPTIMIZERS.items()}
OPTIMIZERS["fast_adamw"] = lambda params: FastAdamW(learning_rate=0.1, parameters=params)


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
    quantized, = model.cache.cached()
    return quantized


def assert_cache_holds_the_weight(model):
    """The cached FP8 copy is the current weight quantised at its scale (not a stale copy)."""
    quantized = cached_weight(model)
    expected = quantize_dequantize(model.linear.weight, 1.0 / quantized.scale_inv, "e4m3")
    np.testing.assert_array_equal((quantized.data.astype(paddle.float32) * quantized.scale_inv).numpy(),
                                  expected.numpy())


def test_paddle_updates_do_not_bump_the_inplace_version():
    """Why freshness is explicit (Paddle 3.3.1): no update that matters moves _inplace_version."""
    linear = paddle.nn.Linear(4, 4)
    for make in STOCK_OPTIMIZERS.values():
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
        # FastAdamW's kernel wrote each new version's amax (AmaxSlot); a stock optimizer leaves the pass
        assert model.cache.amax_passes_skipped == (step if optimizer == "fast_adamw" else 0)
        before = cached_weight(model).data.astype(paddle.float32).numpy()
        model.step()
    model.forward_backward()
    assert_cache_holds_the_weight(model)
    assert not np.array_equal(cached_weight(model).data.astype(paddle.float32).numpy(), before), "stale copy"


def test_an_untracked_stock_optimizer_is_not_seen():
    """The hook is per optimizer instance: an optimizer nobody tracked bumps nothing (what
    weights_updated is for), and tracking one patches no Paddle class."""
    classes = (paddle.optimizer.Optimizer, paddle.optimizer.AdamW, paddle.Tensor)
    before = [dict(vars(cls)) for cls in classes]
    model = Model()
    model.opt = STOCK_OPTIMIZERS["adamw"](model.linear.parameters())
    model.forward_backward()
    model.step()
    model.forward_backward()
    assert model.cache.quantizations == 1
    weights_updated(model.linear)
    model.forward_backward()
    assert model.cache.quantizations == 2
    track_optimizer(model.opt)
    track_optimizer(model.opt)  # idempotent: one hook
    model.step()
    model.forward_backward()
    assert model.cache.quantizations == 3
    assert_cache_holds_the_weight(model)
    assert [dict(vars(cls)) for cls in classes] == before


def test_minimize_and_grad_scaler_requantise():
    model = Model()
    loss = model.forward_backward()
    model.opt.minimize(loss)
    model.opt.clear_grad()
    model.forward_backward()
    assert model.cache.quantizations == 2
    # Disabled on CPU (Paddle warns) it passes through to optimizer.step; enabled on GPU, its
    # step and minimize end in the optimizer's (instance) _apply_optimize too (or skip on found_inf).
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


# Writes Paddle does not report: the loop says so with weights_updated.
UNREPORTED_WRITES = {
    "set_value": lambda p: p.set_value(np.ones(p.shape, np.float32)),
    "set_state_dict": lambda p: p.owner.set_state_dict({"weight": paddle.ones(p.shape),
                                                         "bias": p.owner.bias}),
    "copy_": lambda p: p.copy_(paddle.full(p.shape, 2.0), False),
}
# Writes the parameter's inplace version or buffer shows: seen with no call.
WRITES = {
    "setitem": lambda p: p.__setitem__(slice(None), 4.0),
    "assign": lambda p: paddle.assign(paddle.full(p.shape, 3.0), output=p),
    "shared_buffer": share_new_buffer,
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_writes_the_inplace_version_or_buffer_shows_requantise(write):
    model = Model()
    model.linear.weight.stop_gradient = True  # no optimizer involved
    model.forward_backward()
    with paddle.no_grad():
        keep = WRITES[write](model.linear.weight)
    model.forward_backward()
    assert model.cache.quantizations == 2, write
    assert_cache_holds_the_weight(model)
    del keep


@pytest.mark.parametrize("write", sorted(UNREPORTED_WRITES))
def test_unreported_writes_requantise_after_weights_updated(write):
    model = Model()
    model.linear.weight.stop_gradient = True
    model.forward_backward()
    model.linear.weight.owner = model.linear
    with paddle.no_grad():
        UNREPORTED_WRITES[write](model.linear.weight)
    model.forward_backward()
    assert model.cache.quantizations == 1, f"{write}: Paddle now reports it; the cache could rely on that"
    weights_updated(model.linear)
    model.forward_backward()
    assert model.cache.quantizations == 2, write
    assert_cache_holds_the_weight(model)


def test_weights_updated_takes_parameters_and_leaves_others_cached():
    model, other = Model(), Model()
    model.forward_backward()
    other.forward_backward()
    weights_updated([model.linear.weight])
    model.forward_backward()
    other.forward_backward()
    assert (model.cache.quantizations, other.cache.quantizations) == (2, 1)


def test_clear():
    model = Model()
    model.forward_backward()
    model.cache.clear()
    model.forward_backward()
    assert model.cache.quantizations == 2


# --- the weight's amax from the optimizer (core/fp8/weight_cache.py: AmaxSlot) ---------------------

def fresh_copy(model):
    """The weight's values quantised now by the amax pass (a copy of them: the weight itself keeps
    its one slot, that of the state its layer quantises it under)."""
    state = Fp8Recipe(scaling="delayed", amax_history_len=8).linear_states().weight
    return WeightCache().get(paddle.assign(model.linear.weight), state)


def test_fast_adamws_kernel_hands_the_weights_amax_to_its_next_copy():
    """After FastAdamW's step the next copy skips its amax pass (the kernel wrote the amax where the
    quantisation reads it), and the copy is bit for bit the one an amax pass gives."""
    model = Model("fast_adamw")
    model.forward_backward()
    assert model.cache.amax_passes_skipped == 0, "before any step there is no amax but the pass's"
    for step in range(1, 4):
        model.step()
        model.forward_backward()
        model.forward_backward()
        assert (model.cache.quantizations, model.cache.amax_passes_skipped) == (step + 1, step)
        copy, expected = cached_weight(model), fresh_copy(model)
        np.testing.assert_array_equal(copy.scale_inv.numpy(), expected.scale_inv.numpy())
        np.testing.assert_array_equal(copy.data.astype(paddle.float32).numpy(),
                                      expected.data.astype(paddle.float32).numpy())
        assert_cache_holds_the_weight(model)


@pytest.mark.parametrize("write", ["set_value", "stock_optimizer"])
def test_a_write_after_the_kernels_takes_its_own_amax_pass(write):
    """The kernel's amax is good for the version its update made, not for a later write."""
    model = Model("fast_adamw")
    model.forward_backward()
    model.step()
    if write == "set_value":
        model.linear.weight.set_value(np.full([32, 48], 7.0, np.float32))
        weights_updated(model.linear)
    else:
        stock = track_optimizer(STOCK_OPTIMIZERS["sgd"](model.linear.parameters()))
        model.forward_backward()
        stock.step()
        stock.clear_grad()
    before = (model.cache.quantizations, model.cache.amax_passes_skipped)
    model.forward_backward()
    assert (model.cache.quantizations, model.cache.amax_passes_skipped) == (before[0] + 1, before[1])
    assert_cache_holds_the_weight(model)


def test_training_with_the_kernels_amax_is_bit_identical(monkeypatch):
    """Three steps of an FP8 linear under FastAdamW: the same weights, bit for bit, with and without
    the optimizer's amax (without: every copy takes its amax pass)."""
    from paddle_fastffn.core.fp8 import weight_cache as core_weight_cache

    def train():
        paddle.seed(0)
        model = Model("fast_adamw")
        for _ in range(3):
            model.forward_backward()
            model.step()
        model.forward_backward()
        return model, model.linear.weight.numpy(), cached_weight(model).data.astype(paddle.float32).numpy()

    with_slots, *trained = train()
    monkeypatch.setattr(core_weight_cache, "amax_slot", lambda weight: None)
    without, *reference = train()
    assert (with_slots.cache.amax_passes_skipped, without.cache.amax_passes_skipped) == (3, 0)
    for got, expected in zip(trained, reference):
        np.testing.assert_array_equal(got, expected)


def weight_amax_passes(model, monkeypatch):
    """Counts the amax-only passes over the model's weight (the emulated backend's quantize with
    neither copy asked for)."""
    from paddle_fastffn.fp8.emulated import EMULATED

    passes, quantize = [], EMULATED.quantize

    def counting(x, *args, rowwise=True, transpose=False, **kwargs):
        if not rowwise and not transpose and x is model.linear.weight:
            passes.append(1)
        return quantize(x, *args, rowwise=rowwise, transpose=transpose, **kwargs)

    monkeypatch.setattr(EMULATED, "quantize", counting)
    return passes


def test_per_use_quantisations_take_the_kernels_amax_too(monkeypatch):
    """weight_copies "per_use" (the default: no cache, the weight quantised at every use): every forward
    after a FastAdamW step skips its amax pass, and the outputs are those with the pass."""
    def train(slots: bool):
        paddle.seed(0)
        model = Model("fast_adamw")
        model.cache = None
        passes = weight_amax_passes(model, monkeypatch)
        if not slots:
            from paddle_fastffn.core.fp8 import weight_cache as core_weight_cache

            monkeypatch.setattr(core_weight_cache, "amax_slot", lambda weight: None)
        outputs = []
        for _ in range(3):
            outputs.append(model.forward_backward().numpy())
            outputs.append(model.forward_backward().numpy())  # a second micro-batch of the step
            model.step()
        monkeypatch.undo()
        return len(passes), outputs, model.linear.weight.numpy()

    passes, outputs, weight = train(slots=True)
    reference_passes, reference_outputs, reference_weight = train(slots=False)
    assert (passes, reference_passes) == (2, 6), "with the kernel's amax only the first step's forwards pass"
    np.testing.assert_array_equal(np.array(outputs), np.array(reference_outputs))
    np.testing.assert_array_equal(weight, reference_weight)


def test_a_restored_weight_state_takes_its_own_amax_pass(monkeypatch):
    """The kernel wrote the amax into the weight state's history; a checkpoint restore of that state
    overwrites the history, so the next quantisation measures the weight again."""
    model = Model("fast_adamw")
    model.forward_backward()
    saved = model.states.weight.state_dict()
    model.step()
    model.states.weight.set_state_dict(saved)
    before = (model.cache.quantizations, model.cache.amax_passes_skipped)
    model.forward_backward()
    assert (model.cache.quantizations, model.cache.amax_passes_skipped) == (before[0] + 1, before[1])
    assert_cache_holds_the_weight(model)


def test_apply_gradients_requantises_and_stamps_the_kernels_amax():
    """FastAdamW.apply_gradients (the path Paddle's GradientMerge and Recompute wrappers take) tells the
    weight cache of its update as step() does."""
    model = Model("fast_adamw")
    model.forward_backward()
    before = cached_weight(model).data.astype(paddle.float32).numpy()
    model.opt.apply_gradients([(p, p.grad) for p in model.linear.parameters()])
    model.opt.clear_grad()
    model.forward_backward()
    assert (model.cache.quantizations, model.cache.amax_passes_skipped) == (2, 1)
    assert_cache_holds_the_weight(model)
    assert not np.array_equal(cached_weight(model).data.astype(paddle.float32).numpy(), before)


def test_a_state_shared_by_two_weights_takes_the_amax_pass(monkeypatch):
    """One scaling state quantising two weights (the functional fp8_linear allows it): the kernel's amax
    of one would not be what the history holds, so neither skips its pass, and training matches."""
    def train(slots: bool):
        paddle.seed(0)
        first, second = paddle.nn.Linear(32, 48), paddle.nn.Linear(32, 48)
        states = Fp8Recipe(amax_history_len=8).linear_states()
        opt = FastAdamW(learning_rate=0.1, parameters=first.parameters() + second.parameters())
        if not slots:
            from paddle_fastffn.core.fp8 import weight_cache as core_weight_cache

            monkeypatch.setattr(core_weight_cache, "amax_slot", lambda weight: None)
        outputs = []
        for _ in range(3):
            x = paddle.randn([8, 32])
            y = fp8_linear(x, first.weight, first.bias, states=states) + fp8_linear(x, second.weight, second.bias,
                                                                                    states=states)
            (y ** 2).mean().backward()
            outputs.append(y.numpy())
            opt.step()
            opt.clear_grad()
        monkeypatch.undo()
        return outputs

    np.testing.assert_array_equal(np.array(train(True)), np.array(train(False)))


def test_a_delayed_weight_state_keeps_its_passes_and_trains():
    """A weight state the recipe's layers never make (delayed scaling, a long history: the functional
    fp8_linear takes any states) gets no slot: FastAdamW steps it as before."""
    recipe = Fp8Recipe(amax_history_len=16)
    states = LinearScalingStates(input=recipe.new_state("e4m3"), weight=recipe.new_state("e4m3"),
                                 grad_output=recipe.new_state("e5m2"))
    linear = paddle.nn.Linear(32, 48)
    opt = FastAdamW(learning_rate=0.1, parameters=linear.parameters())
    for _ in range(2):
        (fp8_linear(paddle.randn([8, 32]), linear.weight, linear.bias, states=states) ** 2).mean().backward()
        opt.step()
        opt.clear_grad()
    from paddle_fastffn.core.fp8 import weight_cache as core_weight_cache

    assert core_weight_cache.amax_slot(linear.weight) is None


def test_another_tensors_quantisation_under_the_state_voids_the_kernels_amax():
    """After the step, the weight's state quantises another tensor (a frozen copy of it, here): the
    history now holds that tensor's amax, so the weight's next quantisation measures it again."""
    from paddle_fastffn.core.fp8.linear import FrozenFp8Weight
    from paddle_fastffn.fp8.emulated import EMULATED

    model = Model("fast_adamw")
    model.forward_backward()
    model.step()
    FrozenFp8Weight.freeze(EMULATED, paddle.full([32, 48], 100.0), model.states.weight)
    before = (model.cache.quantizations, model.cache.amax_passes_skipped)
    model.forward_backward()
    assert (model.cache.quantizations, model.cache.amax_passes_skipped) == (before[0] + 1, before[1])
    assert_cache_holds_the_weight(model)
