"""core/lora.py's lora_linear over Paddle (PaddleBackend.linear_accumulate: addmm with alpha =
scaling) against LoRALinear.forward's own formula, base + (x @ A @ B) * scaling, evaluated in
float64 on the same (exactly upcast) inputs: the output and every gradient (x, A, B, the base
weight and bias), on shapes that are not powers of two."""

import paddle
import paddle.nn.functional as F
import pytest

from paddle_fastffn.core.lora import lora_linear
from paddle_fastffn.fp8.linear import _in_fp32_on_cpu
from paddle_fastffn.ops._backend import BACKEND
from tolerances import assert_close

ROWS, IN, OUT, RANK, SCALING = (3, 13), 45, 37, 6, 2.5


def _inputs(dtype):
    paddle.seed(7)
    values = dict(x=paddle.randn([*ROWS, IN]), weight=paddle.randn([IN, OUT]) * IN**-0.5,
                  bias=paddle.randn([OUT]), lora_a=paddle.randn([IN, RANK]) * IN**-0.5,
                  lora_b=paddle.randn([RANK, OUT]) * RANK**-0.5, dy=paddle.randn([*ROWS, OUT]))
    return {name: t.astype(dtype) for name, t in values.items()}


def _run(formula, inputs, dtype):
    """formula's output and the gradients of every input but dy, in `dtype`'s storage (16-bit on the
    CPU: the fp32 upcast Fp8Linear's adapters run under, _in_fp32_on_cpu)."""
    leaves = {name: t.astype(dtype).detach() for name, t in inputs.items() if name != "dy"}
    for t in leaves.values():
        t.stop_gradient = False
    y = _in_fp32_on_cpu(formula, leaves["x"], leaves["weight"], leaves["bias"], leaves["lora_a"], leaves["lora_b"])
    y.backward(inputs["dy"].astype(dtype))
    return y, {name: t.grad for name, t in leaves.items()}


def fused(x, weight, bias, lora_a, lora_b):
    return lora_linear(BACKEND, x, F.linear(x, weight, bias), lora_a, lora_b, SCALING)


def stock(x, weight, bias, lora_a, lora_b):
    return F.linear(x, weight, bias) + (x @ lora_a @ lora_b) * SCALING


@pytest.mark.parametrize("dtype", [paddle.float32, paddle.bfloat16, paddle.float64])
def test_lora_linear_and_every_gradient_match_the_stock_formula(dtype):
    inputs = _inputs(dtype)
    y, grads = _run(fused, inputs, dtype)
    y_ref, grads_ref = _run(stock, {n: t.astype(paddle.float64) for n, t in inputs.items()}, paddle.float64)
    assert y.dtype == dtype and y.shape == [*ROWS, OUT]
    assert_close(y, y_ref, dtype, "y")
    rows = ROWS[0] * ROWS[1]
    for name, grad in grads.items():
        reduced = 1 if name == "x" else rows  # the weights' and bias' gradients sum over the rows
        assert grad.dtype == dtype, name
        assert_close(grad, grads_ref[name], dtype, f"d_{name}", reduced_rows=reduced)


def test_linear_accumulate_casts_an_fp32_weight_to_the_activation_dtype():
    """Under AMP O1 LoRA's parameters stay fp32 while the white-listed GEMMs hand bf16 activations:
    addmm (on no AMP list) would otherwise promote the sum to fp32."""
    base, x, weight = paddle.randn([4, 5]), paddle.randn([4, 3]), paddle.randn([3, 5])
    out = BACKEND.linear_accumulate(base.astype(paddle.float64), x.astype(paddle.float64), weight, 0.5)
    assert out.dtype == paddle.float64
    assert_close(out, base + 0.5 * (x @ weight), paddle.float32, "linear_accumulate")


def test_a_wider_base_keeps_its_dtype_as_stock_promotes():
    """AMP O1 with FP8: the FP8 linear's base comes out in fp32 (x's dtype there) while the adapter's
    first GEMM is autocast to bf16; stock's `base + (x @ A @ B) * scaling` promotes to fp32, and so
    must the fused sum. (Paddle's CPU has no bf16 matmul: float64 and float32 stand in.)"""
    paddle.seed(0)
    base = paddle.randn([4, 8]).astype("float64") * 1e3 + 1.0 / 3
    down, lora_b = paddle.randn([4, 2]), paddle.randn([2, 8])
    stock = base + (down @ lora_b).astype("float64") * 0.5
    fused = BACKEND.linear_accumulate(base, down, lora_b, 0.5)  # writes into base: after stock's sum
    assert fused.dtype == paddle.float64
    assert_close(fused, stock, paddle.float32, "base + 0.5 * down @ B")
