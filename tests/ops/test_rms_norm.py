import math

import numpy as np
import paddle
import pytest

from helpers import DTYPE_IDS, DTYPES, as_float64_leaf, grads_of, random_tensor
from paddle_fastffn import ops
from tolerances import assert_close

SHAPES = [(1, 8), (7, 13), (5, 3, 127), (2, 4096), (33, 1000), (1, 5120)]


def _rows(shape):
    return math.prod(shape[:-1])


def _reference_norm(x64, w64, dtype, eps):
    """PaddleNLP's math on the float64 inputs, including its rounding of the normalised row to the
    weight dtype before the multiply (done on the float64 values so only that rounding remains)."""
    hidden = x64 * paddle.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    if dtype in (paddle.float16, paddle.bfloat16):
        hidden = hidden + (hidden.astype(dtype).astype(paddle.float64) - hidden).detach()
    return hidden * w64


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_reference(shape, dtype, kernel_calls):
    x = random_tensor(shape, dtype, scale=3.0)
    w = random_tensor(shape[-1:], dtype)
    out = ops.rms_norm(x, w, 1e-6)
    x64, w64 = as_float64_leaf(x), as_float64_leaf(w)
    ref = _reference_norm(x64, w64, dtype, 1e-6)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, "rms_norm output")
    upstream = random_tensor(shape, dtype, requires_grad=False)
    d_x, d_w = grads_of([out], [upstream.astype("float32")], [x, w])
    r_x, r_w = grads_of([ref], [upstream.astype("float64")], [x64, w64])
    assert_close(d_x, r_x, dtype, "rms_norm d_x")
    assert_close(d_w, r_w, dtype, "rms_norm d_weight", reduced_rows=_rows(shape))
    assert kernel_calls() == {"fastffn_rms_norm_fwd": 1, "fastffn_rms_norm_bwd": 1}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_add_rms_norm_matches_reference(shape, dtype, kernel_calls):
    x = random_tensor(shape, dtype)
    residual = random_tensor(shape, dtype, scale=2.0)
    w = random_tensor(shape[-1:], dtype)
    out, total = ops.fused_add_rms_norm(x, residual, w, 1e-5)
    x64, r64, w64 = as_float64_leaf(x), as_float64_leaf(residual), as_float64_leaf(w)
    total64 = x64 + r64
    # The stock add stores the sum in `dtype`; the kernel normalises that rounded sum.
    total64 = total64 + (total64.astype(dtype).astype(paddle.float64) - total64).detach()
    ref = _reference_norm(total64, w64, dtype, 1e-5)
    assert_close(total, total64, dtype, "x + residual")
    assert_close(out, ref, dtype, "fused_add_rms_norm output")
    up_out = random_tensor(shape, dtype, requires_grad=False)
    up_total = random_tensor(shape, dtype, requires_grad=False)
    got = grads_of([out, total], [up_out.astype("float32"), up_total.astype("float32")], [x, residual, w])
    want = grads_of([ref, total64], [up_out.astype("float64"), up_total.astype("float64")], [x64, r64, w64])
    assert_close(got[0], want[0], dtype, "d_x")
    assert_close(got[1], want[1], dtype, "d_residual")
    assert_close(got[2], want[2], dtype, "d_weight", reduced_rows=_rows(shape))
    assert kernel_calls() == {"fastffn_rms_norm_fwd": 1, "fastffn_rms_norm_bwd": 1}


def test_fused_add_rms_norm_when_sum_is_unused():
    x, residual = random_tensor((4, 16), "float32"), random_tensor((4, 16), "float32")
    w = random_tensor((16,), "float32")
    out, _ = ops.fused_add_rms_norm(x, residual, w)
    out.sum().backward()
    ref_x, ref_r, ref_w = (as_float64_leaf(t) for t in (x, residual, w))
    ref, _ = ops.fused_add_rms_norm_ref(ref_x, ref_r, ref_w)
    ref.sum().backward()
    assert_close(x.grad, ref_x.grad, paddle.float32, "d_x with unused sum")
    assert_close(residual.grad, ref_r.grad, paddle.float32, "d_residual with unused sum")


def test_rms_norm_matches_paddlenlp_layer():
    from paddlenlp.transformers import LlamaConfig
    from paddlenlp.transformers.llama.modeling import LlamaRMSNorm

    config = LlamaConfig(hidden_size=48, rms_norm_eps=1e-5)
    layer = LlamaRMSNorm(config)
    layer.weight.set_value(paddle.rand([48]) + 0.5)
    x = random_tensor((3, 5, 48), "float32")
    assert_close(ops.rms_norm(x, layer.weight, 1e-5), layer(x), paddle.float32, "vs LlamaRMSNorm")


def test_rms_norm_float64_gradient_against_finite_differences():
    x = random_tensor((2, 6), paddle.float64)
    w = random_tensor((6,), paddle.float64)
    d_x, d_w = paddle.grad((ops.rms_norm(x, w) * paddle.arange(12, dtype="float64").reshape([2, 6])).sum(), [x, w])

    def loss(xv, wv):
        y = ops.rms_norm(paddle.to_tensor(xv), paddle.to_tensor(wv))
        return float((y * paddle.arange(12, dtype="float64").reshape([2, 6])).sum())

    step = 1e-6
    for value, analytic, which in ((x.numpy(), d_x.numpy(), 0), (w.numpy(), d_w.numpy(), 1)):
        numeric = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            plus, minus = value.copy(), value.copy()
            plus[idx] += step
            minus[idx] -= step
            args_p = (plus, w.numpy()) if which == 0 else (x.numpy(), plus)
            args_m = (minus, w.numpy()) if which == 0 else (x.numpy(), minus)
            numeric[idx] = (loss(*args_p) - loss(*args_m)) / (2 * step)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-7)
