"""core/lora.py's two forms over Paddle, lora_linear (PaddleBackend.linear_accumulate: addmm with
alpha = scaling) and the LoraLinear op (ops/lora_linear.py: base and adapter as one node), against
LoRALinear.forward's own formula, base + (x @ A @ B) * scaling, evaluated in float64 on the same
(exactly upcast) inputs: the output and every gradient (x, A, B, the base weight and bias), on
shapes that are not powers of two; LoraLinear over the emulated FP8 base against the FP8 linear
plus lora_linear."""

import paddle
import paddle.nn.functional as F
import pytest

from paddle_fastffn.core.lora import Fp8Base, fused_applies, lora_linear
from paddle_fastffn.ops.lora_linear import lora_linear_fused
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


def fused_op(x, weight, bias, lora_a, lora_b):
    assert bias is None
    return lora_linear_fused(x, weight, lora_a, lora_b, SCALING)


NEEDS = {"all": dict(x=True, weight=True, lora_a=True, lora_b=True),
         "frozen_base": dict(x=True, weight=False, lora_a=True, lora_b=True),
         "x_without_gradient": dict(x=False, weight=False, lora_a=True, lora_b=True),
         "adapters_frozen": dict(x=True, weight=False, lora_a=False, lora_b=False)}


@pytest.mark.parametrize("needs", list(NEEDS.values()), ids=list(NEEDS))
@pytest.mark.parametrize("dtype", [paddle.float32, paddle.float64])
def test_lora_linear_op_gives_the_gradients_asked_for_and_only_those(dtype, needs):
    """The op on Paddle's CPU (fp32 and float64: no 16-bit GEMMs there, fused_applies says so), x's
    gradient written once; every combination a LoRA step meets (a frozen base, layer 0's q/k/v with
    an x that needs no gradient, frozen adapters), None where no gradient is asked for."""
    inputs = _inputs(dtype)
    leaves = {name: t.detach() for name, t in inputs.items() if name not in ("dy", "bias")}
    for name, t in leaves.items():
        t.stop_gradient = not needs[name]
    assert fused_applies(BACKEND, leaves["x"], leaves["x"], leaves["weight"], None, leaves["lora_a"], leaves["lora_b"])
    y = fused_op(leaves["x"], leaves["weight"], None, leaves["lora_a"], leaves["lora_b"])
    y.backward(inputs["dy"])
    ref = {name: t.astype(paddle.float64).detach() for name, t in leaves.items()}
    for t in ref.values():
        t.stop_gradient = False
    y_ref = stock(ref["x"], ref["weight"], None, ref["lora_a"], ref["lora_b"])
    y_ref.backward(inputs["dy"].astype(paddle.float64))
    assert y.dtype == dtype and y.shape == [*ROWS, OUT]
    assert_close(y, y_ref, dtype, "y")
    rows = ROWS[0] * ROWS[1]
    for name, t in leaves.items():
        if not needs[name]:
            assert t.grad is None, name
            continue
        assert t.grad.dtype == dtype, name
        assert_close(t.grad, ref[name].grad, dtype, f"d_{name}", reduced_rows=1 if name == "x" else rows)


def test_autocast_that_changes_the_gemm_dtype_keeps_lora_linear():
    """AMP O1 on a GPU: fp32 activations and weights, 16-bit GEMMs inside the op's forward as outside
    (Paddle's PyLayer keeps autocast on), which its backward would meet beside the fp32 tensors it
    saved; fused_applies says no, from the tracer's AMP level and dtype. O2 (16-bit tensors, the
    autocast dtype) keeps the op. The CPU's auto_cast leaves the tracer at O0, so its state is set
    here as a GPU's auto_cast sets it."""
    tracer = paddle.base.framework._dygraph_tracer()
    x, w, a, b = (paddle.randn(shape) for shape in ([4, 8], [8, 6], [8, 2], [2, 6]))
    assert not BACKEND.autocast_changes_gemm(x)
    level, amp_dtype = tracer._amp_level, tracer._amp_dtype
    try:
        tracer._amp_level, tracer._amp_dtype = paddle.base.core.AmpLevel.O1, "bfloat16"
        assert BACKEND.autocast_changes_gemm(x)
        assert not fused_applies(BACKEND, x, x, w, None, a, b)
        assert not BACKEND.autocast_changes_gemm(x.astype(paddle.bfloat16))
    finally:
        tracer._amp_level, tracer._amp_dtype = level, amp_dtype
    assert fused_applies(BACKEND, x, x, w, None, a, b)


def test_fused_applies_only_without_dropout_bias_or_mixed_dtypes():
    x, w, a, b = (paddle.randn(shape) for shape in ([4, 8], [8, 6], [8, 2], [2, 6]))
    assert fused_applies(BACKEND, x, x, w, None, a, b)
    assert not fused_applies(BACKEND, x, x * 1.0, w, None, a, b)  # dropout gave another tensor
    assert not fused_applies(BACKEND, x, x, w, paddle.randn([6]), a, b)
    assert not fused_applies(BACKEND, x, x, w.astype(paddle.float64), None, a, b)
    assert not fused_applies(BACKEND, x.astype(paddle.bfloat16), x.astype(paddle.bfloat16), None, None,
                             a.astype(paddle.bfloat16), b.astype(paddle.bfloat16))  # no bf16 GEMM on the CPU


@pytest.mark.parametrize("frozen", [False, True], ids=["cached_weight", "frozen_fp8_weight"])
def test_lora_linear_op_over_an_emulated_fp8_base_matches_the_fp8_linear_plus_lora_linear(frozen):
    """The FP8 base inside the op (Fp8LinearOp over the emulated backend) gives what fp8_linear
    followed by lora_linear gives: the same quantisations, x's two gradients summed by the op's
    accumulating GEMM instead of autograd: equal up to the order of fp32 roundings."""
    from paddle_fastffn.core.fp8.linear import FrozenFp8Weight
    from paddle_fastffn.fp8.emulated import EMULATED
    from paddle_fastffn.fp8.linear import fp8_linear
    from paddle_fastffn.fp8.recipe import Fp8Recipe
    from paddle_fastffn.fp8.weight_cache import WeightCache

    paddle.seed(11)
    tokens, width, out = 32, 64, 48
    x0, w0 = paddle.randn([tokens, width]), paddle.randn([width, out]) * width**-0.5
    a0, b0, dy = paddle.randn([width, RANK]) * width**-0.5, paddle.randn([RANK, out]), paddle.randn([tokens, out])

    def run(in_op: bool):
        states, cache = Fp8Recipe().linear_states(), WeightCache()
        x, a, b, weight = (t.clone() for t in (x0, a0, b0, w0))
        for t in (x, a, b):
            t.stop_gradient = False
        weight.stop_gradient = frozen
        held = FrozenFp8Weight.freeze(EMULATED, weight, states.weight) if frozen else None
        if in_op:
            y = lora_linear_fused(x, None if frozen else weight, a, b, SCALING,
                                  Fp8Base(EMULATED, states, None if frozen else cache, held))
        else:
            y = lora_linear(BACKEND, x, fp8_linear(x, None if frozen else weight, states=states,
                                                   weight_cache=None if frozen else cache, frozen_weight=held),
                            a, b, SCALING)
        y.backward(dy)
        return [y.detach(), x.grad, a.grad, b.grad] + ([] if frozen else [weight.grad])

    for name, got, want in zip(("y", "d_x", "d_a", "d_b", "d_weight"), run(True), run(False)):
        # the weights' gradients sum over the tokens, where the two forms' roundings (the scaling
        # inside the GEMM here, after it in lora_linear's autograd) add up
        assert_close(got, want, paddle.float32, name, reduced_rows=1 if name in ("y", "d_x") else tokens)
