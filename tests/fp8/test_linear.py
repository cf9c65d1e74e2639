"""fp8_linear (the emulated Paddle FP8 path, a PyLayer) against fp8_linear_ref (the formulas,
no autograd) and against the unquantised linear within the error budget of tests/tolerances.py;
what backward keeps and quantises; non-finite values; a short convergence run."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from paddle_fastffn.fp8 import (FP8_DTYPES, Fp8Linear, Fp8Recipe, WeightCache, fp8_linear, fp8_linear_ref,
                            scale_from_amax, track_optimizer)
from tolerances import TOLERANCES, assert_close, to_numpy64

# (leading shape of x, in, out): one row, odd sizes, widths not a multiple of 8, a 3-D input.
SHAPES = [((1,), 16, 16), ((7,), 48, 33), ((5,), 13, 29), ((3, 11), 37, 53), ((130,), 250, 17)]
DTYPES = [paddle.float32, paddle.bfloat16, paddle.float16]


def make_inputs(lead, k, n, dtype=paddle.float32, bias=True):
    x = paddle.randn([*lead, k]).astype(dtype)
    w = (paddle.randn([k, n]) / math.sqrt(k)).astype(dtype)
    b = paddle.randn([n]).astype(dtype) if bias else None
    for t in (x, w, b):
        if t is not None:
            t.stop_gradient = False
    dy = paddle.randn([*lead, n]).astype(dtype)
    return x, w, b, dy


def current_scale(t, fmt):
    return scale_from_amax(paddle.abs(t.astype(paddle.float32)).max(), fmt, 0.0, paddle.ones([1]))


def scale_to_use(state, t):
    """The scale `state` quantises t with: t's own amax's (current scaling, the weights, delayed
    scaling's warm start), or else the state's scale before the call (delayed)."""
    return current_scale(t, state.fmt) if state.scales_by_own_amax() else state.scale.clone()


def run_fp8_linear(x, w, b, dy, states):
    """Forward and backward of fp8_linear; also the scales a reference must use."""
    scales = [scale_to_use(states.input, x), current_scale(w, "e4m3"), scale_to_use(states.grad_output, dy)]
    y = fp8_linear(x, w, b, states=states)
    y.backward(dy)
    return y, scales


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead, k, n", SHAPES, ids=str)
def test_matches_reference(lead, k, n, dtype, scaling):
    states = Fp8Recipe(scaling=scaling, amax_history_len=4).linear_states()
    for step in range(3):  # delayed: steps 1, 2 use scales from the history, not the initial 1
        x, w, b, dy = make_inputs(lead, k, n, dtype, bias=step != 1)
        y, (s_in, s_w, s_dy) = run_fp8_linear(x, w, b, dy, states)
        ref = fp8_linear_ref(x, w, b, dy, input_scale=s_in, weight_scale=s_w, grad_scale=s_dy)
        got = (y, x.grad, w.grad, None if b is None else b.grad)
        for name, g, r in zip(("y", "dx", "dw", "db"), got, ref):
            if r is None:
                assert g is None, name
                continue
            assert g.dtype == dtype and g.shape == r.shape, name
            # Same quantised values, fp32 GEMMs in another order at most (dx: matmul with
            # transpose_y against an explicit transpose): fp32 tolerance, then the one rounding
            # into a 16-bit output dtype can land one ulp of it apart.
            assert_close(g, r, dtype, f"{name} step {step}")


def gemm_error_bound(a, b, fmt_a, scale_a, fmt_b, scale_b):
    """Element-wise worst case of sum_k a' b' - a b with a' b' rounded as the tolerance rows say
    (derivation in tests/tolerances.py), plus scale * scale_inv != 1 (2^-23) and the fp32 GEMM's
    own accumulation (K 2^-24 of sum |a' b'|)."""
    atol_a, rtol_a = TOLERANCES[FP8_DTYPES[fmt_a]]
    atol_b, rtol_b = TOLERANCES[FP8_DTYPES[fmt_b]]
    e_a = (rtol_a + 2.0**-23) * np.abs(a) + atol_a / float(scale_a)
    e_b = (rtol_b + 2.0**-23) * np.abs(b) + atol_b / float(scale_b)
    abs_a, abs_b = np.abs(a), np.abs(b)
    accumulation = a.shape[1] * 2.0**-24 * ((abs_a + e_a) @ (abs_b + e_b))
    return e_a @ abs_b + abs_a @ e_b + e_a @ e_b + accumulation


def norm_error_estimate(fmt_a, fmt_b):
    """||error|| / ||result|| of random-sign rounding errors (tests/tolerances.py)."""
    rtol_a, rtol_b = TOLERANCES[FP8_DTYPES[fmt_a]][1], TOLERANCES[FP8_DTYPES[fmt_b]][1]
    return math.sqrt(rtol_a**2 + rtol_b**2) / math.sqrt(3)


def assert_within_fp8_budget(got, a, b, fmts, scales, what):
    ref = a @ b
    err = np.abs(to_numpy64(got) - ref)
    bound = gemm_error_bound(a, b, fmts[0], scales[0], fmts[1], scales[1])
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), (f"{what}: {(err > bound).sum()} elements over the worst-case bound; at "
                                  f"{worst}: error {err[worst]:.3g} > bound {bound[worst]:.3g}")
    norm = np.linalg.norm(err) / np.linalg.norm(ref)
    assert norm <= norm_error_estimate(*fmts), f"{what}: norm-wise error {norm:.4f}"
    assert norm > norm_error_estimate(*fmts) / 4, f"{what}: {norm:.4f}, not quantised?"


@pytest.mark.parametrize("lead, k, n", [((67,), 272, 129), ((4, 33), 512, 96)], ids=str)
def test_error_against_unquantised_linear(lead, k, n):
    """y, dx and dW against the float64 linear of the unquantised inputs: every element within the
    worst-case FP8 bound and the norm-wise error within the random-sign estimate (current scaling:
    nothing saturates)."""
    x, w, _, dy = make_inputs(lead, k, n, bias=False)
    y, (s_in, s_w, s_dy) = run_fp8_linear(x, w, None, dy, Fp8Recipe(scaling="current").linear_states())
    x64, w64, dy64 = (to_numpy64(t).reshape(-1, t.shape[-1]) for t in (x, w, dy))
    assert_within_fp8_budget(y.reshape([-1, n]), x64, w64, ("e4m3", "e4m3"), (s_in, s_w), "y")
    assert_within_fp8_budget(x.grad.reshape([-1, k]), dy64, w64.T, ("e5m2", "e4m3"), (s_dy, s_w), "dx")
    assert_within_fp8_budget(w.grad, x64.T, dy64, ("e4m3", "e5m2"), (s_in, s_dy), "dw")


@pytest.mark.parametrize("weight_copies", ["per_use", "cached"])
def test_backward_keeps_x_in_fp8_and_quantises_grad_in_e5m2(weight_copies):
    """What autograd holds between forward and backward: x as FP8 (1 byte an element) with its fp32
    [1] scale_inv, no high-precision copy of x; W's dgrad FP8 copy with its scale_inv (cached) or W
    itself (per use: backward quantises the dgrad copy, no FP8 weight memory held); backward records
    dy's amax."""
    states = Fp8Recipe().linear_states()
    x, w, b, dy = make_inputs((64,), 128, 96)
    saved = []
    cache = WeightCache() if weight_copies == "cached" else None
    with paddle.autograd.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.shape)) or t, lambda t: t):
        y = fp8_linear(x, w, b, states=states, weight_cache=cache)
    expected = [(paddle.float8_e4m3fn, [64, 128]), (paddle.float32, [1])]  # q(x)^T, its scale_inv
    if weight_copies == "cached":
        expected += [(paddle.float8_e4m3fn, [128, 96]), (paddle.float32, [1])]  # q(W)'s dgrad copy, scale_inv
    else:
        expected += [(paddle.float32, [128, 96])]  # W itself (a parameter: no memory of its own)
    assert sorted(saved, key=str) == sorted(expected, key=str)
    assert not states.grad_output.amax_history.numpy().any()
    y.backward(dy)
    assert float(states.grad_output.amax_history[-1]) == float(dy.abs().max())
    np.testing.assert_array_equal(b.grad.numpy(), dy.sum(axis=0).numpy())  # dbias is not quantised


@pytest.mark.parametrize("dtype", [paddle.float32, paddle.bfloat16])
def test_weight_per_use_is_the_cached_weight_bit_for_bit(dtype):
    """Without a weight cache (recipe.weight_copies "per_use") the dgrad GEMM's copy is quantised in
    backward from the weight and the forward's scale: the same bytes as the cached copy, so y, dx,
    dW and db are equal bit for bit."""
    got = {}
    for mode in ("per_use", "cached"):
        paddle.seed(5)
        states = Fp8Recipe().linear_states()
        x, w, b, dy = make_inputs((48,), 64, 32, dtype)
        y = fp8_linear(x, w, b, states=states, weight_cache=WeightCache() if mode == "cached" else None)
        y.backward(dy)
        got[mode] = [t.astype(paddle.float32).numpy() for t in (y, x.grad, w.grad, b.grad)]
    for per_use, cached in zip(got["per_use"], got["cached"]):
        np.testing.assert_array_equal(per_use, cached)


def test_no_grad_for_frozen_inputs():
    states = Fp8Recipe().linear_states()
    x, w, _, dy = make_inputs((8,), 32, 16, bias=False)
    w.stop_gradient = True
    fp8_linear(x, w, states=states).backward(dy)
    assert w.grad is None and x.grad is not None
    x, w, _, dy = make_inputs((8,), 32, 16, bias=False)
    x.stop_gradient = True
    fp8_linear(x, w, states=states).backward(dy)
    assert x.grad is None and w.grad is not None


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_non_finite_values_stay_non_finite(scaling):
    """A NaN or Inf anywhere shows in what depends on it (the found_inf check of loss scaling
    must see it), never as a finite number."""
    states = Fp8Recipe(scaling=scaling).linear_states()
    for bad in (float("nan"), float("inf")):
        x, w, _, dy = make_inputs((4,), 16, 16, bias=False)
        x_bad = x.detach().numpy()
        x_bad[2, 3] = bad
        x_bad = paddle.to_tensor(x_bad, stop_gradient=False)
        y = fp8_linear(x_bad, w, states=states).numpy()
        assert not np.isfinite(y[2]).any() and np.isfinite(np.delete(y, 2, axis=0)).all()
        dy_bad = dy.numpy()
        dy_bad[1, 5] = bad
        y = fp8_linear(x, w, states=states)
        y.backward(paddle.to_tensor(dy_bad))
        assert not np.isfinite(x.grad.numpy()[1]).any() and not np.isfinite(w.grad.numpy()[:, 5]).any()


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_two_layer_mlp_trains_like_fp32(scaling):
    """50 Adam steps of a 2-layer MLP regressing a fixed teacher: FP8 and fp32 from the same
    initialisation give close losses, and both decrease."""
    def train(use_fp8):
        paddle.seed(7)
        layers = [paddle.nn.Linear(64, 128), paddle.nn.Linear(128, 32)]
        params = [p for layer in layers for p in layer.parameters()]
        recipe = Fp8Recipe(scaling=scaling, amax_history_len=16)
        forwards = [Fp8Linear(layer, recipe) if use_fp8 else layer for layer in layers]
        teacher = paddle.randn([64, 32]) / 8
        opt = track_optimizer(paddle.optimizer.Adam(learning_rate=3e-3, parameters=params))
        losses = []
        for _ in range(50):
            x = paddle.randn([96, 64])
            target = paddle.tanh(x @ teacher)
            pred = forwards[1](paddle.nn.functional.relu(forwards[0](x)))
            loss = ((pred - target) ** 2).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        return np.array(losses)

    fp8, fp32 = train(True), train(False)
    assert fp8[-5:].mean() < 0.3 * fp8[:5].mean() and fp32[-5:].mean() < 0.3 * fp32[:5].mean()
    # FP8 noise (about 5% of each GEMM's output, tests/tolerances.py) shifts the losses a little
    # but not their course: within 5% of fp32's at every step (measured: at most 1.9%).
    np.testing.assert_allclose(fp8, fp32, rtol=0.05)
