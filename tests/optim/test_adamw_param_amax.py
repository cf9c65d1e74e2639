"""The AdamW kernel's param_amax (fastffn/optimizer.h): max |param| of the parameter it just stored, in every
weight and moment layout, equal bit for bit to the max numpy takes over the stored values; written, not
accumulated; NaN when a NaN was stored; and a bad buffer is named by both the Python checks and the binding."""

import numpy as np
import paddle
import pytest

from paddle_fastffn.optim import adamw_update_
from paddle_fastffn.optim.adamw import _adamw_op

HYPER = dict(beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.1)
# (moments, param dtype, where the fp32 weight comes from): every layout the kernel has
LAYOUTS = [("fp32", "float32", "param"), ("fp32", "bfloat16", "master"), ("fp32", "float16", "master"),
           ("fp32", "bfloat16", "param"), ("fp32", "bfloat16", "compensated"), ("int8", "bfloat16", "master"),
           ("int8", "float32", "param"), ("int8", "float16", "compensated")]
SIZES = [3 * 256 + 77, 8, 1]


def state(param, moments, weights):
    n = param.size
    out = {"master_param": param.astype(paddle.float32) if weights == "master" else None,
           "compensation": paddle.zeros([n], param.dtype) if weights == "compensated" else None}
    if moments == "int8":
        blocks = -(-n // 256)
        out.update(moment1=paddle.full([n], 127, paddle.uint8), moment2=paddle.zeros([n], paddle.uint8),
                   moment1_absmax=paddle.zeros([blocks]), moment2_absmax=paddle.zeros([blocks]))
    else:
        out.update(moment1=paddle.zeros([n]), moment2=paddle.zeros([n]))
    return out


def step(param, grad, tensors, param_amax, pows):
    adamw_update_(param, grad, paddle.to_tensor([1e-2]), beta1_pow=pows[0], beta2_pow=pows[1],
                  param_amax=param_amax, **tensors, **HYPER)


def stored_amax(param) -> np.float32:
    return np.abs(param.astype(paddle.float32).numpy()).max()


@pytest.mark.parametrize("n", SIZES, ids=str)
@pytest.mark.parametrize("moments, dtype, weights", LAYOUTS, ids="-".join)
def test_param_amax_is_the_stored_parameters_max(n, moments, dtype, weights):
    rng = np.random.default_rng(n)
    param = paddle.to_tensor(rng.standard_normal(n).astype(np.float32) * 3).astype(dtype)
    tensors = state(param, moments, weights)
    pows = [paddle.to_tensor([0.9]), paddle.to_tensor([0.999])]
    param_amax = paddle.to_tensor([1e9], paddle.float32)  # written, not max-accumulated: this goes
    for _ in range(3):
        grad = paddle.to_tensor(rng.standard_normal(n).astype(np.float32)).astype(dtype)
        step(param, grad, tensors, param_amax, pows)
        assert param_amax.numpy()[0] == stored_amax(param), (moments, dtype, weights)


def test_a_stored_nan_makes_param_amax_nan():
    param = paddle.ones([300], "bfloat16")
    grad = paddle.to_tensor(np.where(np.arange(300) == 7, np.nan, 1.0).astype(np.float32)).astype("bfloat16")
    param_amax = paddle.zeros([1])
    step(param, grad, state(param, "fp32", "master"), param_amax, [paddle.to_tensor([0.9]),
                                                                    paddle.to_tensor([0.999])])
    assert np.isnan(param_amax.numpy()[0])


def test_without_param_amax_the_update_is_the_same():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(1000).astype(np.float32)
    grad = paddle.to_tensor(rng.standard_normal(1000).astype(np.float32)).astype("bfloat16")
    results = []
    for param_amax in (None, paddle.zeros([1])):
        param = paddle.to_tensor(values).astype("bfloat16")
        tensors = state(param, "fp32", "master")
        step(param, grad, tensors, param_amax, [paddle.to_tensor([0.9]), paddle.to_tensor([0.999])])
        results.append([param.astype("float32").numpy(), tensors["master_param"].numpy(), tensors["moment1"].numpy()])
    for without, with_amax in zip(*results):
        np.testing.assert_array_equal(without, with_amax)


@pytest.mark.parametrize("param_amax, message", [
    (paddle.zeros([2]), "`param_amax` must be a one-element float32 tensor"),
    (paddle.zeros([1], "float64"), "`param_amax` must be a one-element float32 tensor"),
])
def test_bad_param_amax_is_named(param_amax, message):
    param = paddle.zeros([300], "bfloat16")
    with pytest.raises(TypeError, match=message):
        step(param, paddle.zeros([300], "bfloat16"), state(param, "fp32", "master"), param_amax,
             [paddle.to_tensor([0.9]), paddle.to_tensor([0.999])])


def test_the_binding_names_a_bad_param_amax_too():
    """The compiled op checks on its own (a caller that skips adamw_update_'s checks)."""
    n = 300
    base = [paddle.zeros([n]), paddle.zeros([n]), paddle.to_tensor([0.1]), paddle.zeros([n]), paddle.zeros([n]),
            paddle.to_tensor([0.9]), paddle.to_tensor([0.999]), None, None, 0.9, 0.999, 1e-8, 1.0, 0.0, True]
    with pytest.raises(Exception, match="`param_amax` must hold one value"):
        _adamw_op(*base, param_amax=paddle.zeros([2]))
    with pytest.raises(Exception, match="`param_amax` must be float32"):
        _adamw_op(*base, param_amax=paddle.zeros([1], "float64"))
    param = base[0]
    with pytest.raises(Exception, match="param_amax must not alias"):
        _adamw_op(*base[:3], paddle.zeros([n]), paddle.zeros([n]), *base[5:], param_amax=param[:1])
