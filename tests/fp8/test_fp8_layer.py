"""Fp8Linear: the FP8 path of a paddle.nn.Linear or a PaddleNLP LoRALinear, which GEMMs stay in
high precision (first/last layer, small GEMMs, misaligned weights: warnings and strict mode)."""

from __future__ import annotations

import warnings

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddle_fastffn.fp8 import Fp8Linear, Fp8Recipe, WeightCache, fp8_linear, track_optimizer
from paddle_fastffn.fp8 import linear as fp8_linear_module
from paddle_fastffn.ops._fallback import UnrequestedFallbackError
from tolerances import assert_close


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(fp8_linear_module, "_warned", set())


def twin(recipe):
    """fp8_linear with states and cache as a fresh Fp8Linear's, to run beside it."""
    states, cache = recipe.linear_states(), WeightCache()
    return lambda x, layer: fp8_linear(x, layer.weight, layer.bias, states=states, weight_cache=cache)


@pytest.mark.parametrize("weight_copies", ["per_use", "cached"])
def test_plain_linear_is_fp8_linear_and_keeps_its_parameters(weight_copies):
    """A trained weight's FP8 copies: cached, one quantisation per weight version; per use (the
    default), none held."""
    recipe = Fp8Recipe(weight_copies=weight_copies)
    layer = paddle.nn.Linear(48, 32)
    names = list(layer.state_dict())
    fp8, reference = Fp8Linear(layer, recipe), twin(recipe)
    for _ in range(2):
        x = paddle.randn([5, 48])
        np.testing.assert_array_equal(fp8(x).numpy(), reference(x, layer).numpy())
    assert list(layer.state_dict()) == names
    assert fp8.weight_cache.quantizations == (1 if weight_copies == "cached" else 0)
    assert len(fp8.weight_cache.cached()) == (1 if weight_copies == "cached" else 0)
    saved = fp8.fp8_state_dict()
    other = Fp8Linear(layer, recipe)
    other.set_fp8_state_dict(saved)
    np.testing.assert_array_equal(other.states.input.amax_history.numpy(),
                                  fp8.states.input.amax_history.numpy())


def high_precision(layer, x):
    up = [t.astype(paddle.float32) for t in (x, layer.weight, layer.bias)]
    return F.linear(*up).astype(x.dtype)


def test_first_and_last_layers_stay_high_precision():
    recipe = Fp8Recipe(first_last_bf16=True)
    layer, x = paddle.nn.Linear(32, 16), paddle.randn([4, 32])
    for index, fp8_expected in [(0, False), (1, True), (2, True), (3, False)]:
        fp8 = Fp8Linear(layer, recipe, layer_index=index, num_layers=4)
        assert fp8.uses_fp8(4) is fp8_expected
        same = np.array_equal(fp8(x).numpy(), high_precision(layer, x).numpy())
        assert same is not fp8_expected, index


def test_small_gemms_stay_high_precision_without_warnings():
    recipe = Fp8Recipe(min_gemm_size=8 * 16 * 32, weight_copies="cached")  # the cache counts the FP8 calls
    layer = paddle.nn.Linear(32, 16)
    fp8 = Fp8Linear(layer, recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        x = paddle.randn([7, 32])  # 7 * 16 * 32 < min_gemm_size: by design, not a fallback
        np.testing.assert_array_equal(fp8(x).numpy(), high_precision(layer, x).numpy())
    assert fp8.weight_cache.quantizations == 0
    fp8(paddle.randn([8, 32]))
    assert fp8.weight_cache.quantizations == 1


def test_misaligned_weight_warns_and_stays_high_precision(allow_fallback, fresh_warnings):
    layer = paddle.nn.Linear(40, 24)  # 40 % 16 != 0
    with pytest.warns(RuntimeWarning, match=r"weight \[40, 24\] is not a multiple of 16"):
        fp8 = Fp8Linear(layer, Fp8Recipe())
    x = paddle.randn([3, 40])
    np.testing.assert_array_equal(fp8(x).numpy(), high_precision(layer, x).numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        Fp8Linear(paddle.nn.Linear(40, 24), Fp8Recipe())  # once per shape
        Fp8Linear(paddle.nn.Linear(40, 24), Fp8Recipe(first_last_bf16=True), layer_index=0, num_layers=2)


def test_misaligned_weight_is_an_error_in_strict_mode():
    with pytest.raises(UnrequestedFallbackError, match="not a multiple of 16"):
        Fp8Linear(paddle.nn.Linear(32, 20), Fp8Recipe())


def test_only_linear_layers():
    with pytest.raises(TypeError, match="wraps paddle.nn.Linear"):
        Fp8Linear(paddle.nn.Conv1D(4, 4, 1), Fp8Recipe())


@pytest.mark.parametrize("min_gemm_size", [0, 10**9], ids=["fp8", "high_precision"])
def test_bf16_activations(min_gemm_size):
    """bf16 in, bf16 out on both paths (Paddle CPU has no bf16 matmul: the high-precision path
    computes in fp32 there); gradients reach bf16 weights."""
    layer = paddle.nn.Linear(32, 16)
    layer.to(dtype=paddle.bfloat16)
    x = paddle.randn([6, 32]).astype(paddle.bfloat16)
    x.stop_gradient = False
    recipe = Fp8Recipe(min_gemm_size=min_gemm_size)
    y = Fp8Linear(layer, recipe)(x)
    assert y.dtype == paddle.bfloat16
    y.astype(paddle.float32).sum().backward()
    assert x.grad.dtype == paddle.bfloat16 and layer.weight.grad.dtype == paddle.bfloat16
    expected = high_precision(layer, x) if min_gemm_size else twin(recipe)(x, layer)
    np.testing.assert_array_equal(y.astype(paddle.float32).numpy(), expected.astype(paddle.float32).numpy())


@pytest.fixture
def lora_layer():
    from paddlenlp.peft.lora.lora_layers import LoRALinear

    layer = LoRALinear(in_features=48, out_features=32, r=4, lora_alpha=8, merge_weights=True)
    layer.lora_B.set_value(paddle.randn(layer.lora_B.shape) * 0.1)  # PaddleNLP initialises B to 0
    return layer


def test_lora_base_in_fp8_adapters_in_high_precision(lora_layer):
    recipe = Fp8Recipe()
    fp8, reference = Fp8Linear(lora_layer, recipe), twin(recipe)
    x = paddle.randn([5, 48])
    dy = paddle.randn([5, 32])
    y = fp8(x)
    y.backward(dy)
    base = reference(x, lora_layer)
    adapters = lambda a, b: (x @ a @ b) * lora_layer.scaling  # noqa: E731  LoRALinear.forward's math
    assert_close(y, base + adapters(lora_layer.lora_A, lora_layer.lora_B), paddle.float32, "y")
    a, b = (paddle.to_tensor(p.numpy(), stop_gradient=False) for p in (lora_layer.lora_A, lora_layer.lora_B))
    adapters(a, b).backward(dy)
    assert_close(lora_layer.lora_A.grad, a.grad, paddle.float32, "lora_A grad")
    assert_close(lora_layer.lora_B.grad, b.grad, paddle.float32, "lora_B grad")
    assert lora_layer.weight.grad is None, "the base weight stays frozen"


def _state_values(states) -> dict:
    return {role: {k: np.asarray(v).copy() for k, v in state.items()} for role, state in states.state_dict().items()}


@pytest.mark.parametrize("layer_kind", ["linear", "lora_base_held_in_fp8"])
def test_no_token_leaves_the_scaling_states_untouched(layer_kind, lora_layer):
    """A mixture-of-experts expert the router gave no token ([0, in]): an empty output and
    gradients, and no amax of the empty tensor recorded, so delayed scaling's first real call still
    warm-starts from its own amax (the empty call would otherwise mark the states seeded with
    amax 0 and keep scale 1); a base held only in FP8 stays so (not re-quantised for it)."""
    paddle.seed(3)
    layer = paddle.nn.Linear(48, 32, bias_attr=False) if layer_kind == "linear" else lora_layer
    fp8 = Fp8Linear(layer, Fp8Recipe(scaling="delayed"))
    if layer_kind != "linear":  # the base frozen and held in FP8 by a first call
        fp8(paddle.randn([4, 48]))
        assert fp8.holds_frozen_weight() and fp8.frozen_quantizations == 1
    before = _state_values(fp8.states)
    x = paddle.zeros([0, 48])
    x.stop_gradient = False
    y = fp8(x)
    assert y.shape == [0, 32] and not fp8.uses_fp8(0)
    y.sum().backward()
    assert x.grad.shape == [0, 48]
    after = _state_values(fp8.states)
    for role in before:
        for key in before[role]:
            np.testing.assert_array_equal(after[role][key], before[role][key], err_msg=f"{role}.{key}")
    if layer_kind == "linear":
        assert not fp8.states.input.seeded and fp8.states.input.scales_by_own_amax()
        x = paddle.randn([4, 48]) * 100  # the warm start scales by this amax, not by 1
        fp8(x)
        assert_close(fp8.states.input.scale, 448.0 / paddle.abs(x).max().reshape([1]), paddle.float32, "scale")
    else:
        assert fp8.frozen_quantizations == 1 and fp8.holds_frozen_weight()


def quantizations(fp8) -> int:
    """The base weight's quantisations: into the weight cache, or into a FrozenFp8Weight."""
    return fp8.weight_cache.quantizations + fp8.frozen_quantizations


@pytest.mark.parametrize("frozen_weights", ["fp8", "fp8_both", "resident"])
def test_lora_base_weight_is_quantised_once_for_the_run_and_again_after_merge(lora_layer, frozen_weights):
    from paddle_fastffn.integration.fp8_attach import attach_fp8_linear, detach_fp8_linear

    recipe = Fp8Recipe(scaling="current", frozen_weights=frozen_weights)  # the twin below then needs no history
    fp8 = Fp8Linear(lora_layer, recipe)
    attach_fp8_linear(lora_layer, fp8)  # as the patch does: its guard of LoRALinear's merge included
    opt = track_optimizer(paddle.optimizer.AdamW(learning_rate=1e-2, parameters=lora_layer.parameters()))
    for _ in range(3):
        (lora_layer(paddle.randn([4, 48])) ** 2).mean().backward()
        opt.step()
        opt.clear_grad()
    assert quantizations(fp8) == 1, "frozen base weight: one quantisation"
    assert fp8.holds_frozen_weight() == (frozen_weights != "resident")
    lora_layer.eval()  # merges the adapters into the weight (set_value)
    x = paddle.randn([4, 48])
    merged = lora_layer(x)
    assert quantizations(fp8) == 2
    np.testing.assert_array_equal(merged.numpy(), twin(recipe)(x, lora_layer).numpy(),
                                  "merged: the base GEMM alone, on the merged weight")
    lora_layer.train()  # unmerges
    lora_layer(x)
    assert quantizations(fp8) == 3
    detach_fp8_linear(lora_layer)
    assert "train" not in lora_layer.__dict__ and "eval" not in lora_layer.__dict__


@pytest.mark.parametrize("held", ["fp8", "fp8_both"])
def test_lora_base_held_only_in_fp8_has_the_resident_paths_numerics(lora_layer, held):
    """recipe.frozen_weights "fp8" (the weight's forward copy only, transposed for dgrad in backward)
    against "resident" (the weight cache's two copies): the same quantisation, so the same output,
    input gradient and adapter gradients, bit for bit; the 16-bit weight moved to host memory with
    its values, and back where it was on restore."""
    import copy

    original, home_pointer = lora_layer.weight.numpy().copy(), lora_layer.weight.data_ptr()
    twin_layer = copy.deepcopy(lora_layer)
    results = {}
    for mode, layer in ((held, lora_layer), ("resident", twin_layer)):
        fp8 = Fp8Linear(layer, Fp8Recipe(scaling="current", frozen_weights=mode))
        out = {}
        for step in range(2):
            paddle.seed(step)
            x = paddle.randn([6, 48])
            x.stop_gradient = False
            y = fp8(x)
            y.backward(paddle.randn([6, 32]))
            out[step] = [t.numpy().copy() for t in (y, x.grad, layer.lora_A.grad, layer.lora_B.grad)]
            layer.clear_gradients()
        results[mode] = (fp8, out)
    fp8, out = results[held]
    for step in out:
        for name, held, resident in zip(("y", "dx", "lora_A grad", "lora_B grad"), out[step], results["resident"][1][step]):
            np.testing.assert_array_equal(held, resident, f"step {step}: {name}")
    assert fp8.weight_cache.quantizations == 0 and fp8.frozen_quantizations == 1
    assert lora_layer.weight.grad is None
    assert lora_layer.weight.data_ptr() != home_pointer, "the 16-bit weight left its buffer for host memory"
    np.testing.assert_array_equal(lora_layer.weight.numpy(), original, "the host copy keeps the weight's values")
    fp8.restore_weight()
    np.testing.assert_array_equal(lora_layer.weight.numpy(), original)
    assert fp8._frozen is None, "restored: the FP8-only copy is dropped, the next forward quantises again"


def test_frozen_fp8_weight_record_and_the_ops_argument_check():
    """A FrozenFp8Weight is the forward's stored copy (1 byte an element + its scale_inv), and the
    op takes either a weight or one (the torch CPU smoke runs the real transpose of the copy:
    tests/torch_cpu/test_fp8_frozen_weight.py)."""
    from paddle_fastffn.core.fp8.linear import WEIGHT_COPIES, FrozenFp8Weight
    from paddle_fastffn.fp8.emulated import EMULATED

    recipe = Fp8Recipe(scaling="current")
    weight = paddle.randn([48, 32])
    frozen = FrozenFp8Weight.freeze(EMULATED, weight, recipe.linear_states().weight)
    assert frozen.copies == (WEIGHT_COPIES["in_out"]["forward"],) and frozen.shape == (48, 32)
    assert frozen.nbytes() == 48 * 32 + 4
    x = paddle.randn([5, 48])
    with pytest.raises(ValueError, match="either weight .* or frozen_weight"):
        fp8_linear(x, weight, states=recipe.linear_states(), frozen_weight=frozen)
    with pytest.raises(ValueError, match="either weight .* or frozen_weight"):
        fp8_linear(x, None, states=recipe.linear_states())
