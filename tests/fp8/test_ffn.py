"""fp8_ffn (the emulated FP8 FFN, a PyLayer) against fp8_ffn_ref (the formulas, no autograd) for the
output and every gradient, and against the unquantised FFN within the FP8 FFN budget; the scaling
states under both recipes (the delayed warm start included); what backward keeps; Fp8FFN.

The CUDA backend's call sequence is traced in tests/integration/test_composition.py."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from paddle_fastffn.fp8 import (FP8_MAX, Fp8FFN, Fp8Recipe, WeightCache, fp8_ffn, fp8_ffn_cuda, fp8_ffn_ref,
                            scale_from_amax, track_optimizer)
from tolerances import FP8_FFN_BUDGET, assert_close, assert_relative_norm_within, to_numpy64

# (leading shape of x, H, I): H and I multiples of 16 (the FP8 GEMMs' alignment); token counts that
# are not (the emulation and the CUDA path take any), one token, a 3-D input.
SHAPES = [((1,), 16, 16), ((37,), 64, 176), ((3, 11), 48, 32), ((130,), 128, 80)]
DTYPES = [paddle.float32, paddle.bfloat16]
OUTPUTS = ("y", "d_x", "d_w_gate_up", "d_w_down")


def ffn_inputs(lead, hidden, inter, dtype=paddle.float32, seed=0):
    paddle.seed(seed)
    x = paddle.randn([*lead, hidden]).astype(dtype)
    w_gate_up = (paddle.randn([hidden, 2 * inter]) / math.sqrt(hidden)).astype(dtype)
    w_down = (paddle.randn([inter, hidden]) / math.sqrt(inter)).astype(dtype)
    for t in (x, w_gate_up, w_down):
        t.stop_gradient = False
    return x, w_gate_up, w_down, paddle.randn([*lead, hidden]).astype(dtype)


def run_ffn(x, w_gate_up, w_down, dy, states):
    """Forward and backward of fp8_ffn: {output: tensor} and {role: the scale it was quantised
    with}: its own amax's where the state scales by it (then that is the state's scale after the
    call: current scaling, and delayed's warm start, whose history then holds only that amax),
    the state's scale before the call otherwise (delayed)."""
    roles = states.roles()
    own = {r: getattr(states, r).scales_by_own_amax() for r in roles}
    before = {r: getattr(states, r).scale.clone() for r in roles}
    x, w_gate_up, w_down = (leaf(t) for t in (x, w_gate_up, w_down))
    y = fp8_ffn(x, w_gate_up, w_down, states=states)
    y.backward(dy)
    used = {r: getattr(states, r).scale.clone() if own[r] else before[r] for r in roles}
    return dict(zip(OUTPUTS, (y, x.grad, w_gate_up.grad, w_down.grad))), used


def leaf(t):
    """A fresh leaf with t's values, so gradients do not accumulate across runs."""
    copy = t.detach().clone()
    copy.stop_gradient = t.stop_gradient
    return copy


def reference(x, w_gate_up, w_down, dy, used):
    return dict(zip(OUTPUTS, fp8_ffn_ref(
        x, w_gate_up, w_down, dy, x_scale=used["x"], w_gate_up_scale=used["w_gate_up"],
        w_down_scale=used["w_down"], h_scale=used["h"], grad_scale=used["dy"], d_gate_up_scale=used["d_gate_up"],
        gate_up_scale=used.get("gate_up"))))


@pytest.mark.parametrize("saved_gate_up", ["fp8", "activation"])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead, hidden, inter", SHAPES, ids=str)
def test_matches_reference(lead, hidden, inter, dtype, scaling, saved_gate_up):
    states = Fp8Recipe(scaling=scaling, amax_history_len=4, saved_gate_up=saved_gate_up).ffn_states()
    assert ("gate_up" in states.roles()) == (saved_gate_up == "fp8")
    for step in range(3):  # delayed: step 0 warm-starts, steps 1 and 2 use the history
        x, w_gate_up, w_down, dy = ffn_inputs(lead, hidden, inter, dtype, seed=step)
        got, used = run_ffn(x, w_gate_up, w_down, dy, states)
        ref = reference(x, w_gate_up, w_down, dy, used)
        for name in OUTPUTS:
            g, r = got[name], ref[name]
            assert g.dtype == r.dtype == dtype and g.shape == r.shape, name
            # The same quantised values and 16-bit roundings, fp32 GEMMs: the output dtype's row.
            assert_close(g, r, dtype, f"{name} step {step}")


def ffn64(x, w_gate_up, w_down, dy):
    """The unquantised FFN and its gradients in float64 (numpy)."""
    x, w_gu, w_d, dy = (to_numpy64(t).reshape(-1, t.shape[-1]) for t in (x, w_gate_up, w_down, dy))
    gate_up = x @ w_gu
    g, u = np.split(gate_up, 2, axis=1)
    sig = 1 / (1 + np.exp(-g))
    h = g * sig * u
    d_h = dy @ w_d.T
    d_gu = np.concatenate([d_h * u * sig * (1 + g * (1 - sig)), d_h * g * sig], axis=1)
    return dict(zip(OUTPUTS, (h @ w_d, d_gu @ w_gu.T, x.T @ d_gu, h.T @ dy)))


@pytest.mark.parametrize("saved_gate_up", ["fp8", "activation"])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("lead, hidden, inter", [((4, 33), 256, 688), ((67,), 128, 352)], ids=str)
def test_error_against_the_unquantised_ffn_is_within_the_fp8_budget(lead, hidden, inter, scaling, saved_gate_up):
    states = Fp8Recipe(scaling=scaling, saved_gate_up=saved_gate_up).ffn_states()
    for step in range(2):  # delayed: the warm-started step and one on the history
        x, w_gate_up, w_down, dy = ffn_inputs(lead, hidden, inter, seed=10 + step)
        got, _ = run_ffn(x, w_gate_up, w_down, dy, states)
        exact = ffn64(x, w_gate_up, w_down, dy)
        for name in OUTPUTS:
            value = got[name].reshape([-1, got[name].shape[-1]])
            error = assert_relative_norm_within(value, exact[name], FP8_FFN_BUDGET[name], f"{name} step {step}")
            assert error > FP8_FFN_BUDGET[name] / 8, f"{name}: {error:.4f}, not quantised?"


def current_scale(t, fmt):
    return float(scale_from_amax(paddle.abs(t.astype(paddle.float32)).max(), fmt, 0.0, paddle.ones([1])))


def test_delayed_first_step_is_current_scaling_and_later_steps_follow_the_history():
    """Warm start: step 0 of delayed scaling quantises every tensor as current scaling does (the
    outputs are the same bits) and seeds each history with its amax; step 1 uses those histories,
    not its own amaxes. Without the warm start (TE), step 0 runs on scales of 1."""
    recipe = Fp8Recipe(amax_history_len=8)
    delayed, current = recipe.ffn_states(), Fp8Recipe(scaling="current").ffn_states()
    x, w_gate_up, w_down, dy = ffn_inputs((40,), 64, 96)
    dy = dy * 1e-6  # gradients of a mean loss: at a scale of 1, e5m2 flushes them to zero (< 2^-17)
    got, used = run_ffn(x, w_gate_up, w_down, dy, delayed)
    want, used_current = run_ffn(x, w_gate_up, w_down, dy, current)
    for name in OUTPUTS:
        np.testing.assert_array_equal(to_numpy64(got[name]), to_numpy64(want[name]), err_msg=name)
    for role in delayed.roles():
        assert float(used[role]) == float(used_current[role]) != 1.0, role
        state = getattr(delayed, role)
        if state.mode == "delayed":
            assert state.amax_history.numpy()[-1] > 0 and not state.amax_history.numpy()[:-1].any(), role
    assert float(used["dy"]) == current_scale(dy, "e5m2")

    x2, w_gate_up2, w_down2, dy2 = ffn_inputs((40,), 64, 96, seed=1)
    x2 = x2 * 4  # a larger amax: delayed scaling does not see it before the step ends
    before = {role: float(getattr(delayed, role).scale) for role in delayed.roles()}
    _, used = run_ffn(x2, w_gate_up2, w_down2, dy2 * 1e-6, delayed)
    assert float(used["x"]) == before["x"] == used_current["x"] and float(used["x"]) > current_scale(x2, "e4m3")
    assert float(used["w_gate_up"]) == current_scale(w_gate_up2, "e4m3"), "weights: current scaling"
    assert float(delayed.x.scale) == pytest.approx(FP8_MAX["e4m3"] / float(paddle.abs(x2).max()), rel=1e-6)

    te = Fp8Recipe(amax_history_len=8, delayed_warm_start=False).ffn_states()
    got_te, used_te = run_ffn(x, w_gate_up, w_down, dy, te)
    assert all(float(used_te[role]) == 1.0 for role in ("x", "h", "dy", "d_gate_up"))
    assert not got_te["d_w_gate_up"].abs().max(), "TE's first step: the e5m2 gradients underflowed to 0"


def test_weights_are_quantised_once_per_version_and_states_save_and_restore():
    layer = Fp8FFN(paddle.nn.Linear(64, 192, bias_attr=False), paddle.nn.Linear(96, 64, bias_attr=False),
                   Fp8Recipe(amax_history_len=4, weight_copies="cached"), backend="emulated")
    optimizer = track_optimizer(paddle.optimizer.SGD(learning_rate=0.1,
                                                     parameters=[layer.gate_up.weight, layer.down.weight]))
    for _ in range(3):
        for _ in range(2):  # two micro-batches: one quantisation per weight
            layer(paddle.randn([5, 7, 64])).mean().backward()
        optimizer.step()
        optimizer.clear_grad()
    assert layer.weight_cache.quantizations == 2 * 3
    saved = layer.fp8_state_dict()
    assert set(saved) == {"x", "w_gate_up", "w_down", "h", "dy", "d_gate_up", "gate_up"}
    other = Fp8FFN(layer.gate_up, layer.down, Fp8Recipe(amax_history_len=4))
    other.set_fp8_state_dict(saved)
    for role in saved:
        restored = getattr(other.states, role)
        np.testing.assert_array_equal(restored.amax_history.numpy(), saved[role]["amax_history"])
        assert restored.seeded


@pytest.mark.parametrize("weight_copies", ["per_use", "cached"])
@pytest.mark.parametrize("saved_gate_up", ["fp8", "activation"])
def test_backward_keeps_fp8_copies_and_gate_up_as_the_recipe_says(saved_gate_up, weight_copies):
    """What autograd holds between forward and backward: q(x) with its scale_inv, gate_up (the
    SwiGLU recompute reads it) as its e4m3 copy (saved_gate_up "fp8", its scale_inv beside it) or in
    the activation dtype, h's scale; the weights' dgrad FP8 copies with their scale_inv (cached), or
    the weights themselves (per use: no FP8 weight memory held); no copy of h or x in 16 or 32 bits."""
    states = Fp8Recipe(saved_gate_up=saved_gate_up).ffn_states()
    x, w_gate_up, w_down, dy = ffn_inputs((20,), 64, 96, paddle.bfloat16)
    saved = []
    cache = WeightCache() if weight_copies == "cached" else None
    with paddle.autograd.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.shape)) or t, lambda t: t):
        y = fp8_ffn(x, w_gate_up, w_down, states=states, weight_cache=cache)
    e4m3, f32 = paddle.float8_e4m3fn, paddle.float32
    # gate_up: its e4m3 copy and that copy's scale_inv, or the bf16 tensor alone
    gate_up = [(e4m3, [20, 192]), (f32, [1])] if saved_gate_up == "fp8" else [(paddle.bfloat16, [20, 192])]
    if weight_copies == "cached":  # the dgrad FP8 copies with their scale_inv
        weights = [(e4m3, [64, 192]), (f32, [1]), (e4m3, [96, 64]), (f32, [1])]
    else:  # the weights themselves (parameters: no memory of their own)
        weights = [(paddle.bfloat16, [64, 192]), (paddle.bfloat16, [96, 64])]
    expected = [(e4m3, [20, 64]), (f32, [1]), *gate_up, (f32, [1]), *weights]
    assert sorted(saved, key=str) == sorted(expected, key=str)
    y.backward(dy)
    assert float(states.d_gate_up.amax_history[-1]) > 0 and float(states.dy.amax_history[-1]) == float(
        dy.astype(f32).abs().max())


def test_weight_copies_per_use_are_the_cached_copies_bit_for_bit():
    """recipe.weight_copies "per_use" (the default: each GEMM's weight copy quantised when it runs,
    the dgrad copies in backward) against "cached": the same outputs and gradients, bit for bit,
    over two steps with an update between them; per use holds no copy."""
    results = {}
    for mode in ("per_use", "cached"):
        paddle.seed(3)
        layer = Fp8FFN(paddle.nn.Linear(64, 192, bias_attr=False), paddle.nn.Linear(96, 64, bias_attr=False),
                       Fp8Recipe(amax_history_len=4, weight_copies=mode), backend="emulated")
        optimizer = track_optimizer(paddle.optimizer.SGD(learning_rate=0.1,
                                                         parameters=[layer.gate_up.weight, layer.down.weight]))
        got = []
        for step in range(2):
            x = paddle.randn([3, 16, 64])
            x.stop_gradient = False
            y = layer(x)
            y.mean().backward()
            got += [y.numpy(), x.grad.numpy(), layer.gate_up.weight.grad.numpy(), layer.down.weight.grad.numpy()]
            optimizer.step()
            optimizer.clear_grad()
        results[mode] = got
        assert (layer.weight_cache.quantizations == 0) == (mode == "per_use")
        assert not layer.weight_cache.cached() or mode == "cached"
    for per_use, cached in zip(results["per_use"], results["cached"]):
        np.testing.assert_array_equal(per_use, cached)


def test_no_grad_for_frozen_inputs():
    states = Fp8Recipe().ffn_states()
    x, w_gate_up, w_down, dy = ffn_inputs((8,), 32, 48)
    w_gate_up.stop_gradient = True
    fp8_ffn(x, w_gate_up, w_down, states=states).backward(dy)
    assert w_gate_up.grad is None and x.grad is not None and w_down.grad is not None
    x, w_gate_up, w_down, dy = ffn_inputs((8,), 32, 48)
    x.stop_gradient = True
    w_down.stop_gradient = True
    fp8_ffn(x, w_gate_up, w_down, states=states).backward(dy)
    assert x.grad is None and w_down.grad is None and w_gate_up.grad is not None


@pytest.mark.parametrize("call, error, message", [
    (lambda s: fp8_ffn(paddle.randn([4, 32]), paddle.randn([32, 96]), paddle.randn([40, 32]), states=s),
     ValueError, r"w_gate_up \[32, 96\] and w_down \[40, 32\] must be \[H, 2I\] and \[I, H\]"),
    (lambda s: fp8_ffn(paddle.randn([4, 48]), paddle.randn([32, 96]), paddle.randn([48, 32]), states=s),
     ValueError, r"x's last dimension 48 must be w_gate_up's H = 32"),
    (lambda s: fp8_ffn_cuda(paddle.randn([4, 32]), paddle.randn([32, 40]), paddle.randn([20, 32]), states=s,
                            weight_cache=None), ValueError, r"I = 20 must be multiples of 16"),
    (lambda s: Fp8FFN(paddle.nn.Linear(32, 64), paddle.nn.Linear(32, 32, bias_attr=False), Fp8Recipe()),
     TypeError, r"`gate_up` must be a paddle.nn.Linear without bias"),
    (lambda s: Fp8FFN(paddle.nn.Linear(40, 48, bias_attr=False), paddle.nn.Linear(24, 40, bias_attr=False),
                      Fp8Recipe()), ValueError, r"H = 40 and I = 24 must be multiples of 16"),
    (lambda s: Fp8FFN(paddle.nn.Linear(32, 64, bias_attr=False), paddle.nn.Linear(32, 32, bias_attr=False),
                      Fp8Recipe(), backend="gpu"), ValueError, r"backend must be"),
    (lambda s: Fp8FFN(paddle.nn.Linear(32, 64, bias_attr=False), paddle.nn.Linear(32, 32, bias_attr=False),
                      Fp8Recipe(), backend="cuda")(paddle.randn([2, 32])), RuntimeError, r"not a CUDA tensor"),
])
def test_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call(Fp8Recipe().ffn_states())
