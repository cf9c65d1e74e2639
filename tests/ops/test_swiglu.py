import numpy as np
import paddle
import pytest

from helpers import DTYPE_IDS, DTYPES, as_float64_leaf, grads_of, random_tensor
from paddle_fastffn import ops
from tolerances import assert_close

# Not powers of two, one row, odd widths, a 3-D batch, a long row (LLaMA-2 7B intermediate).
SHAPES = [(1, 1), (1, 7), (7, 13), (3, 5, 123), (2, 11008), (65, 431)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "pair"])
def test_swiglu_matches_reference_forward_and_backward(shape, dtype, packed, kernel_calls):
    if packed:
        inputs = [random_tensor(shape[:-1] + (2 * shape[-1],), dtype, scale=2.0)]
    else:
        inputs = [random_tensor(shape, dtype, scale=2.0), random_tensor(shape, dtype)]
    out = ops.swiglu(*inputs)
    assert out.dtype == dtype and list(out.shape) == list(shape)

    ref_inputs = [as_float64_leaf(t) for t in inputs]
    ref = ops.swiglu_ref(*ref_inputs)
    assert_close(out, ref, dtype, "swiglu output")

    upstream = random_tensor(shape, dtype, requires_grad=False)
    grads = grads_of([out], [upstream.astype(paddle.float32)], inputs)
    ref_grads = grads_of([ref], [upstream.astype(paddle.float64)], ref_inputs)
    for name, g, rg in zip(["d_x", "d_y"], grads, ref_grads):
        assert g.dtype == dtype
        assert_close(g, rg, dtype, f"swiglu {name}")
    assert kernel_calls() == {"fastffn_swiglu_fwd": 1, "fastffn_swiglu_bwd": 1}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_swiglu_reusing_its_inputs_memory_gives_the_reference_gradients_in_place(dtype, kernel_calls):
    """reuse_input_memory (the unfused MLP's gate_proj/up_proj outputs): the two-input backward
    writes d_x over x and d_y over y, and the gradients are the reference's."""
    leaves = [random_tensor((7, 131), dtype, scale=2.0), random_tensor((7, 131), dtype)]
    x, y = (t * 1 for t in leaves)  # the MLP's intermediates: memory only this op reads afterwards
    out = ops.swiglu(x, y, reuse_input_memory=True)
    ref_inputs = [as_float64_leaf(t) for t in leaves]
    ref = ops.swiglu_ref(*ref_inputs)
    assert_close(out, ref, dtype, "swiglu output")
    upstream = random_tensor((7, 131), dtype, requires_grad=False)
    d_x, d_y = paddle.grad([out], [x, y], [upstream])
    ref_grads = grads_of([ref], [upstream.astype(paddle.float64)], ref_inputs)
    for name, g, rg in zip(["d_x", "d_y"], (d_x, d_y), ref_grads):
        assert_close(g, rg, dtype, f"swiglu {name}")
    # x and y now hold their gradients: no [tokens, 2I] was allocated for them.
    np.testing.assert_array_equal(x.astype("float32").numpy(), d_x.astype("float32").numpy())
    np.testing.assert_array_equal(y.astype("float32").numpy(), d_y.astype("float32").numpy())
    assert kernel_calls() == {"fastffn_swiglu_fwd": 1, "fastffn_swiglu_pair_bwd_inplace": 1}


def test_swiglu_reuse_input_memory_needs_two_inputs():
    with pytest.raises(ValueError, match="reuse_input_memory applies to two inputs"):
        ops.swiglu(random_tensor((2, 8), paddle.float32), reuse_input_memory=True)


def test_swiglu_saturates_without_nan():
    x = paddle.to_tensor([[-1e4, -100.0, -88.0, 0.0, 88.0, 100.0, 1e4, 3.0]], dtype="float32")
    x.stop_gradient = False
    out = ops.swiglu(x)
    assert_close(out, ops.swiglu_ref(as_float64_leaf(x)), paddle.float32, "saturated swiglu")
    (d_x,) = paddle.grad(out.sum(), [x])
    assert np.isfinite(d_x.numpy()).all()


def test_swiglu_non_contiguous_input_is_correct():
    base = random_tensor((12, 10), paddle.float32, requires_grad=False)
    view = base.transpose([1, 0])
    assert_close(ops.swiglu(view), ops.swiglu_ref(view.astype("float64")), paddle.float32,
                 "swiglu on a transposed view")


def test_swiglu_nan_propagates():
    x = paddle.to_tensor([[float("nan"), 1.0]], dtype="float32")
    assert np.isnan(ops.swiglu(x).numpy()).all()


def test_swiglu_float64_gradient_against_finite_differences():
    x = random_tensor((3, 10), paddle.float64)
    (analytic,) = paddle.grad(ops.swiglu(x).sum(), [x])
    base = x.numpy()
    numeric = np.zeros_like(base)
    step = 1e-6
    for idx in np.ndindex(base.shape):
        plus, minus = base.copy(), base.copy()
        plus[idx] += step
        minus[idx] -= step
        f = lambda v: float(ops.swiglu(paddle.to_tensor(v)).sum())  # noqa: E731
        numeric[idx] = (f(plus) - f(minus)) / (2 * step)
    np.testing.assert_allclose(analytic.numpy(), numeric, rtol=1e-6, atol=1e-8)


def test_swiglu_down_proj_recompute_matches_stored_path():
    # float32 only: Paddle CPU has no half-precision matmul for the GEMMs around the kernel (the
    # kernel's half-precision paths are covered by the swiglu tests above).
    dtype = paddle.float32
    gate_up = random_tensor((2, 9, 2 * 37), dtype)
    weight = random_tensor((37, 21), dtype, scale=0.2)
    out = ops.swiglu_down_proj(gate_up, weight)
    ref_in, ref_w = as_float64_leaf(gate_up), as_float64_leaf(weight)
    ref = paddle.matmul(ops.swiglu_ref(ref_in), ref_w)
    assert_close(out, ref, dtype, "swiglu_down_proj output")
    upstream = random_tensor((2, 9, 21), dtype, requires_grad=False)
    grads = grads_of([out], [upstream], [gate_up, weight])
    ref_grads = grads_of([ref], [upstream.astype("float64")], [ref_in, ref_w])
    assert_close(grads[0], ref_grads[0], dtype, "d_gate_up")
    assert_close(grads[1], ref_grads[1], dtype, "d_weight", reduced_rows=18)


def test_swiglu_down_proj_frozen_weight_gets_no_gradient():
    gate_up = random_tensor((4, 10), paddle.float32)
    weight = random_tensor((5, 3), paddle.float32, requires_grad=False)
    ops.swiglu_down_proj(gate_up, weight).sum().backward()
    assert gate_up.grad is not None and weight.grad is None


def test_swiglu_down_proj_in_place_backward_on_an_intermediate_matches():
    x = random_tensor((3, 7, 16), paddle.float32)
    w_gu = random_tensor((16, 2 * 19), paddle.float32, scale=0.3)
    w_d = random_tensor((19, 16), paddle.float32, scale=0.3)
    upstream = random_tensor((3, 7, 16), paddle.float32, requires_grad=False)
    grads = {}
    for reuse in (False, True):
        out = ops.swiglu_down_proj(paddle.matmul(x, w_gu), w_d, reuse_gate_up_memory=reuse)
        grads[reuse] = grads_of([out], [upstream], [x, w_gu, w_d])
    for got, want in zip(grads[True], grads[False]):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
