"""Recipe logic: options and their validation, TE's scale formula, current scaling, delayed
scaling's amax history (order, window, reduction) and what happens to 0 / NaN / Inf amaxes."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_fastffn.fp8 import FP8_MAX, Fp8Recipe, scale_from_amax

SCALING = ["current", "delayed"]


def tensor_with_amax(amax: float, n: int = 64) -> paddle.Tensor:
    """Values in [-amax, amax] with max |x| exactly amax (also for 0, NaN, Inf)."""
    x = paddle.uniform([n], min=-0.5, max=0.5) * (amax if np.isfinite(amax) else 1.0)
    return paddle.concat([x, paddle.to_tensor([amax], paddle.float32)])


def expected_scale(amax, fmt="e4m3", margin=0.0):
    return np.float32(np.float32(FP8_MAX[fmt]) * np.float32(2.0**-margin)) / np.float32(amax)


def scale_used(q) -> float:
    return float(1.0 / q.scale_inv)


def test_defaults_are_transformer_engines():
    r = Fp8Recipe()
    assert (r.scaling, r.forward_format, r.backward_format) == ("delayed", "e4m3", "e5m2")
    assert (r.amax_history_len, r.amax_compute_algo, r.margin) == (1024, "max", 0.0)
    assert (r.first_last_bf16, r.min_gemm_size) == (False, 0)
    assert r.delayed_warm_start  # not TE's: TE starts every delayed scale at 1 (Fp8Recipe's docstring)
    assert r.saved_gate_up == "fp8"  # not TE's either: TE keeps the 16-bit SwiGLU input
    assert "gate_up" in r.ffn_states().roles()
    assert "gate_up" not in Fp8Recipe(saved_gate_up="activation").ffn_states().roles()


@pytest.mark.parametrize("bad, message", [
    (dict(scaling="dynamic"), "scaling must be one of"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo must be one of"),
    (dict(forward_format="e3m4"), "unknown FP8 format"),
    (dict(backward_format="fp8"), "unknown FP8 format"),
    (dict(amax_history_len=0), "amax_history_len must be >= 1"),
    (dict(amax_history_len=True), "amax_history_len must be int"),
    (dict(amax_history_len=16.0), "amax_history_len must be int"),
    (dict(margin=float("nan")), "margin must be a finite number"),
    (dict(margin="1"), "margin must be a finite number"),
    (dict(min_gemm_size=-1), "min_gemm_size must be >= 0"),
    (dict(first_last_bf16="yes"), "first_last_bf16 must be bool"),
    (dict(delayed_warm_start=1), "delayed_warm_start must be bool"),
    (dict(saved_gate_up="bf16"), "saved_gate_up must be one of"),
])
def test_invalid_options_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        Fp8Recipe(**bad)


def test_from_dict_takes_prefixed_fields():
    args = {"fp8_scaling": "current", "fp8_margin": 1, "fp8_first_last_bf16": True,
            "learning_rate": 3e-4, "use_fast_ffn": True}
    r = Fp8Recipe.from_dict(args, prefix="fp8_")
    assert (r.scaling, r.margin, r.first_last_bf16, r.amax_history_len) == ("current", 1, True, 1024)
    assert Fp8Recipe.from_dict(r.as_dict()) == r
    with pytest.raises(ValueError, match=r"unknown FP8 recipe options \['fp8_history'\]"):
        Fp8Recipe.from_dict({"fp8_history": 16}, prefix="fp8_")


def test_weights_use_current_scaling_under_both_recipes():
    for scaling in SCALING:
        states = Fp8Recipe(scaling=scaling).linear_states()
        modes = (states.input.mode, states.weight.mode, states.grad_output.mode)
        assert modes == (scaling, "current", scaling)
        assert (states.input.fmt, states.weight.fmt, states.grad_output.fmt) == ("e4m3", "e4m3", "e5m2")


def test_first_last_layers_and_min_gemm_size():
    r = Fp8Recipe(first_last_bf16=True, min_gemm_size=4096 * 4096 * 4096)
    assert [r.layer_uses_fp8(i, 4) for i in range(4)] == [False, True, True, False]
    assert all(Fp8Recipe().layer_uses_fp8(i, 4) for i in range(4))
    assert r.gemm_uses_fp8(4096, 4096, 4096) and not r.gemm_uses_fp8(4095, 4096, 4096)
    assert Fp8Recipe().gemm_uses_fp8(1, 1, 1)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0.0, 1.0, 2.5])
def test_scale_formula(fmt, margin):
    amax = paddle.to_tensor([3.7])
    got = scale_from_amax(amax, fmt, margin, previous=paddle.ones([1]))
    assert got.numpy()[0] == expected_scale(3.7, fmt, margin)


@pytest.mark.parametrize("amax", [0.0, float("nan"), float("inf"), -float("inf")])
def test_scale_keeps_previous_for_unusable_amax(amax):
    previous = paddle.to_tensor([12.5])
    assert scale_from_amax(paddle.to_tensor([amax]), "e4m3", 0.0, previous).numpy()[0] == 12.5


def test_scale_of_tiny_amax_stays_finite_and_zeros_stay_zero():
    state = Fp8Recipe(scaling="current").new_state("e4m3")
    q = state.quantize(paddle.to_tensor([1e-40, 0.0, -1e-40]))  # fp32 subnormal amax: 448 / amax = Inf
    assert np.isfinite(state.scale.numpy()).all()
    values = (q.data.astype(paddle.float32) * q.scale_inv).numpy()
    assert not np.isnan(values).any() and values[1] == 0


@pytest.mark.parametrize("margin", [0.0, 1.0])
def test_current_scaling_uses_this_tensors_amax(margin):
    state = Fp8Recipe(scaling="current", margin=margin).new_state("e4m3")
    for amax in [2.0, 300.0, 0.01]:
        x = tensor_with_amax(amax)
        q = state.quantize(x)
        assert scale_used(q) == pytest.approx(float(expected_scale(amax, margin=margin)), rel=1e-6)
        top = q.data.astype(paddle.float32).abs().max()
        assert float(top) == FP8_MAX["e4m3"] * 2.0**-margin, "amax maps onto the format's max / 2^margin"


def test_current_scaling_keeps_the_scale_for_zero_and_nan_tensors():
    state = Fp8Recipe(scaling="current").new_state("e4m3")
    state.quantize(tensor_with_amax(4.0))
    before = float(state.scale)
    q = state.quantize(paddle.zeros([8]))
    assert float(state.scale) == before and not q.data.astype(paddle.float32).abs().max()
    q = state.quantize(paddle.to_tensor([1.0, float("nan")]))
    assert float(state.scale) == before
    assert np.isnan(q.data.astype(paddle.float32).numpy()[1]), "NaN stays visible"


@pytest.mark.parametrize("warm_start", [True, False], ids=["warm_start", "te"])
@pytest.mark.parametrize("history_len", [1, 2, 3])
def test_delayed_scaling_uses_the_history_up_to_the_previous_step(history_len, warm_start):
    """Step t's scale comes from the amaxes of the last `len` steps before t (step 0: its own
    amax with the warm start, TE's initial scale 1 without); after step t the history is TE's:
    [0] = 0 (the next step's slot), then the steps t - len + 2 .. t, oldest first."""
    state = Fp8Recipe(amax_history_len=history_len, delayed_warm_start=warm_start).new_state("e4m3")
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25, 4.0]
    for t, amax in enumerate(amaxes):
        q = state.quantize(tensor_with_amax(amax))
        window = amaxes[max(0, t - history_len):t] or ([amax] if warm_start else [])
        expected = 1.0 if not window else float(expected_scale(max(window)))
        assert scale_used(q) == pytest.approx(expected, rel=1e-6), f"step {t}"
        kept = amaxes[:t + 1][-(history_len - 1):] if history_len > 1 else []
        expected_history = [0.0] * (history_len - len(kept)) + kept
        assert state.amax_history.numpy().tolist() == expected_history, f"step {t}"
    # after the last step: the next scale covers the last `len` amaxes
    assert float(state.scale) == pytest.approx(float(expected_scale(max(amaxes[-history_len:]))), rel=1e-6)
    assert float(state.scale_inv) == pytest.approx(1 / float(state.scale), rel=1e-7)


def test_warm_start_scales_the_first_quantisation_by_its_own_amax_then_follows_the_history():
    """The first quantisation of a delayed-scaling tensor is current scaling's, bit for bit, and
    seeds the history; the second uses that history (not its own, larger amax)."""
    delayed = Fp8Recipe(amax_history_len=4).new_state("e5m2")
    current = Fp8Recipe(scaling="current").new_state("e5m2")
    first, second = tensor_with_amax(3e-6), tensor_with_amax(5e-5)  # gradients below e5m2's range at scale 1
    q, q_current = delayed.quantize(first), current.quantize(first)
    assert scale_used(q) == scale_used(q_current) == pytest.approx(float(expected_scale(3e-6, "e5m2")), rel=1e-6)
    codes = [t.data.astype(paddle.float32).numpy() for t in (q, q_current)]
    np.testing.assert_array_equal(*codes)
    assert q.data.astype(paddle.float32).abs().max() > 0, "nothing underflows"
    assert delayed.seeded and delayed.amax_history.numpy()[-1] == np.float32(3e-6)
    q = delayed.quantize(second)
    assert scale_used(q) == pytest.approx(float(expected_scale(3e-6, "e5m2")), rel=1e-6), "the history's scale"
    te = Fp8Recipe(amax_history_len=4, delayed_warm_start=False).new_state("e5m2")
    q = te.quantize(first)
    assert scale_used(q) == 1.0 and not q.data.astype(paddle.float32).abs().max(), "TE: all of it flushes to 0"


def test_warm_start_of_a_zero_tensor_keeps_the_scale_and_restored_histories_continue():
    state = Fp8Recipe(amax_history_len=4).new_state("e4m3")
    state.quantize(paddle.zeros([8]))
    assert float(state.scale) == 1.0 and state.seeded  # amax 0: the previous scale, as every rule
    trained = Fp8Recipe(amax_history_len=4).new_state("e4m3")
    trained.quantize(tensor_with_amax(2.0))
    restored = Fp8Recipe(amax_history_len=4).new_state("e4m3")
    restored.set_state_dict(trained.state_dict())
    assert restored.seeded and not restored.scales_by_own_amax()
    assert scale_used(restored.quantize(tensor_with_amax(50.0))) == pytest.approx(224.0, rel=1e-6)
    fresh = Fp8Recipe(amax_history_len=4).new_state("e4m3")
    restored.set_state_dict(fresh.state_dict())
    assert not restored.seeded and restored.scales_by_own_amax(), "an empty history warm-starts again"


def test_delayed_most_recent_uses_the_last_amax_only():
    state = Fp8Recipe(amax_history_len=16, amax_compute_algo="most_recent").new_state("e5m2")
    for amax in [100.0, 1.0]:
        state.quantize(tensor_with_amax(amax))
    assert float(state.scale) == pytest.approx(float(expected_scale(1.0, "e5m2")), rel=1e-6)


def test_delayed_margin():
    state = Fp8Recipe(margin=2).new_state("e4m3")
    state.quantize(tensor_with_amax(7.0))
    assert float(state.scale) == pytest.approx(448.0 / 7.0 / 4.0, rel=1e-6)


def test_delayed_zero_and_nan_amax_keep_the_scale():
    for algo in ("most_recent", "max"):
        state = Fp8Recipe(amax_history_len=4, amax_compute_algo=algo).new_state("e4m3")
        state.quantize(tensor_with_amax(3.0))
        kept = float(state.scale)
        state.quantize(paddle.zeros([4]))
        state.quantize(tensor_with_amax(float("nan")))
        assert float(state.scale) == kept, algo
        assert np.isnan(state.amax_history.numpy()[-1]), "the NaN amax is recorded (visible)"


def test_delayed_max_ignores_nan_and_holds_on_inf_until_it_leaves_the_window():
    """TE's fmaxf reduction: NaN entries drop out of the max; an Inf one makes the amax Inf, which
    keeps the previous scale for as long as it stays in the window."""
    state = Fp8Recipe(amax_history_len=2).new_state("e4m3")
    state.quantize(tensor_with_amax(float("nan")))
    state.quantize(tensor_with_amax(2.0))
    assert float(state.scale) == pytest.approx(224.0, rel=1e-6), "NaN ignored next to a finite amax"
    state.quantize(tensor_with_amax(float("inf")))
    assert float(state.scale) == pytest.approx(224.0, rel=1e-6), "Inf in the window: scale kept"
    state.quantize(tensor_with_amax(4.0))
    assert float(state.scale) == pytest.approx(224.0, rel=1e-6)
    state.quantize(tensor_with_amax(8.0))
    assert float(state.scale) == pytest.approx(56.0, rel=1e-6), "Inf left the window"


def test_state_dict_round_trip():
    recipe = Fp8Recipe(amax_history_len=4)
    states = recipe.linear_states()
    for amax in (1.0, 5.0):
        states.input.quantize(tensor_with_amax(amax))
        states.grad_output.quantize(tensor_with_amax(amax / 1000))
    restored = recipe.linear_states()
    restored.set_state_dict(states.state_dict())
    for role in ("input", "weight", "grad_output"):
        for name in ("scale", "scale_inv", "amax_history"):
            np.testing.assert_array_equal(getattr(getattr(restored, role), name).numpy(),
                                          getattr(getattr(states, role), name).numpy())
    with pytest.raises(ValueError, match="amax_history_len"):
        Fp8Recipe(amax_history_len=8).linear_states().set_state_dict(states.state_dict())


# --- activation recompute (fp8/recompute.py) -------------------------------------------------------

def _deferred_recompute(function, *args):
    """A recompute in miniature: runs the function now, and hands back its later replay."""
    return function(*args), lambda: function(*args)


def test_recompute_replay_uses_the_forwards_scales_and_records_nothing():
    from paddle_fastffn.fp8.recompute import fp8_recompute

    state = Fp8Recipe(amax_history_len=4).new_state("e4m3")
    x1, x2 = paddle.randn([8, 16]), paddle.randn([8, 16]) * 3
    state.quantize(x1 * 0.5)  # a first step: the history holds an amax, the scale is delayed from here on

    def layer(x):
        return state.quantize(x).data

    recompute = fp8_recompute(_deferred_recompute)
    first, replay_1 = recompute(layer, x1)  # quantised with the history's scale, which then rolls
    used = 1.0 / float(state.scale_inv)
    second, replay_2 = recompute(layer, x2)
    history, scale = state.amax_history.numpy().copy(), float(state.scale)
    np.testing.assert_array_equal(replay_1().numpy().view(np.uint8), first.numpy().view(np.uint8))
    np.testing.assert_array_equal(replay_2().numpy().view(np.uint8), second.numpy().view(np.uint8))
    np.testing.assert_array_equal(state.amax_history.numpy(), history)  # the replays recorded nothing
    assert float(state.scale) == scale != used
    with pytest.raises(RuntimeError, match="replays an FP8 quantisation .* that its forward did not make"):
        replay_1()  # a second replay of one forward has no scale left


def test_recompute_forward_without_backward_leaves_nothing_behind():
    import gc

    from paddle_fastffn.fp8.recompute import fp8_recompute

    state = Fp8Recipe(amax_history_len=4).new_state("e5m2")
    _, replay = fp8_recompute(_deferred_recompute)(lambda x: state.quantize(x), paddle.randn([4, 4]))
    assert len(state._forward_scales) == 1
    del replay  # the recompute's graph freed before any backward
    gc.collect()
    assert len(state._forward_scales) == 0
    current = Fp8Recipe(scaling="current").new_state("e4m3")
    fp8_recompute(_deferred_recompute)(lambda x: current.quantize(x), paddle.randn([4, 4]))
    assert len(current._forward_scales) == 0  # current scaling needs no replay state


# (outer, inner) reentrant. Paddle 3.3.1 itself cannot nest the others, with or without FP8: a
# non-reentrant recompute inside a non-reentrant one raises ("only one pair of hooks is allowed at a
# time"), and a reentrant one inside a non-reentrant one gives the outer weight a wrong gradient
# (measured with plain matmuls: 286 off after three steps).
@pytest.mark.parametrize("outer_reentrant, inner_reentrant", [(True, True), (True, False)],
                         ids=["reentrant_in_reentrant", "non_reentrant_in_reentrant"])
def test_nested_paddle_recompute_replays_with_the_forwards_scales(outer_reentrant, inner_reentrant):
    """Paddle's recompute nested in itself around emulated FP8 linears under delayed scaling: the
    same gradients and amax histories as without recompute (the inner call's replay finds the
    scales its first run filed, recompute.py)."""
    from paddle.distributed.fleet.utils import recompute

    from paddle_fastffn.fp8 import fp8_linear
    from paddle_fastffn.fp8.recompute import fp8_recompute

    wrapped = fp8_recompute(recompute)

    def run(use_recompute):
        recipe = Fp8Recipe(amax_history_len=4)
        states = [recipe.linear_states(), recipe.linear_states()]
        paddle.seed(7)
        w1, w2 = paddle.randn([16, 32]), paddle.randn([32, 16])
        for w in (w1, w2):
            w.stop_gradient = False

        def inner(h):
            return fp8_linear(paddle.nn.functional.relu(h), w2, states=states[1])

        def outer(x):
            h = fp8_linear(x, w1, states=states[0])
            return wrapped(inner, h, use_reentrant=inner_reentrant) if use_recompute else inner(h)

        for step in range(3):
            x = paddle.randn([8, 16]) * (step + 1)
            x.stop_gradient = False
            y = wrapped(outer, x, use_reentrant=outer_reentrant) if use_recompute else outer(x)
            y.sum().backward()
        grads = [w1.grad.numpy(), w2.grad.numpy()]
        return grads, [s.input.amax_history.numpy() for s in states]

    plain_grads, plain_histories = run(False)
    grads, histories = run(True)
    for got, want in zip(grads + histories, plain_grads + plain_histories):
        np.testing.assert_array_equal(got, want)


def test_states_saved_without_a_role_load_with_that_role_fresh():
    """A state dict from before gate_up's FP8 copy (or saved_gate_up "activation") restores every
    role it holds; gate_up stays fresh and warm-starts."""
    old = Fp8Recipe(amax_history_len=4, saved_gate_up="activation").ffn_states()
    old.x.quantize(paddle.randn([4, 16]))
    states = Fp8Recipe(amax_history_len=4).ffn_states()
    states.set_state_dict(old.state_dict())
    np.testing.assert_array_equal(states.x.amax_history.numpy(), old.x.amax_history.numpy())
    assert states.x.seeded and not states.gate_up.seeded and not states.gate_up.amax_history.numpy().any()
