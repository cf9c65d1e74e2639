"""core/lora.py's two forms over the harness's backend, lora_linear (TorchBackend.linear_accumulate:
addmm with alpha = scaling, in the storage dtype) and the LoraLinear op (base and adapter as one
node), against the stock formula x @ W^T + (x @ A^T @ B^T) * scaling evaluated in float64 on the
same inputs: the output and every gradient, fp32 and bf16 (the rows of the one tolerance table,
tests/dtype_tolerances.py); LoraLinear over an FP8 base against the FP8 linear plus lora_linear."""

import pytest
import torch

from dtype_tolerances import BY_NAME
from paddle_fastffn.core.lora import lora_linear
from paddle_fastffn.torch import ops
from paddle_fastffn.torch.ops import BACKEND

ROWS, IN, OUT, RANK, SCALING = (3, 13), 45, 37, 6, 2.5


def _run(formula, inputs, dtype):
    leaves = {name: t.detach().to(dtype).requires_grad_() for name, t in inputs.items() if name != "dy"}
    y = formula(**leaves)
    y.backward(inputs["dy"].to(dtype))
    return y, {name: t.grad for name, t in leaves.items()}


def fused(x, weight, lora_a, lora_b):
    return lora_linear(BACKEND, x, x @ weight.t(), lora_a, lora_b, SCALING)


def fused_op(x, weight, lora_a, lora_b):
    return ops.LoraLinear.apply(x, weight, None, lora_a, lora_b, SCALING, None)


def stock(x, weight, lora_a, lora_b):
    return x @ weight.t() + (x @ lora_a.t() @ lora_b.t()) * SCALING


@pytest.mark.parametrize("formula", [fused, fused_op], ids=["lora_linear", "LoraLinear"])
@pytest.mark.parametrize("rows", [ROWS, (ROWS[0] * ROWS[1],)], ids=["3d", "2d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_and_every_gradient_match_the_stock_formula(dtype, rows, formula):
    """lora_linear: a 3-D base reaches its sum as a view (out of place), a 2-D one takes it in place;
    LoraLinear: its forward holds the base as rows either way."""
    gen = torch.Generator().manual_seed(7)
    inputs = dict(x=torch.randn(*rows, IN, generator=gen), weight=torch.randn(OUT, IN, generator=gen) * IN**-0.5,
                  lora_a=torch.randn(RANK, IN, generator=gen) * IN**-0.5,
                  lora_b=torch.randn(OUT, RANK, generator=gen) * RANK**-0.5, dy=torch.randn(*rows, OUT, generator=gen))
    inputs = {name: t.to(dtype) for name, t in inputs.items()}  # the reference sees the same rounded values
    y, grads = _run(formula, inputs, dtype)
    y_ref, grads_ref = _run(stock, inputs, torch.float64)
    atol, rtol = BY_NAME[str(dtype).removeprefix("torch.")]
    assert y.dtype == dtype
    # Each result is checked against the magnitude of the terms it sums (the element-wise bound): y
    # and d_x add the base's term to the adapter's, both rounded to the storage dtype first (in the
    # stock formula too), and the weights' gradients sum over the rows, where a sum that cancels
    # keeps the rounding errors of its terms.
    x, w, a, b, dy = (inputs[n].double().abs() for n in ("x", "weight", "lora_a", "lora_b", "dy"))
    x2, dy2 = x.reshape(-1, IN), dy.reshape(-1, OUT)
    magnitudes = dict(x=dy @ w + SCALING * (dy @ b) @ a, weight=dy2.t() @ x2,
                      lora_a=SCALING * (dy2 @ b).t() @ x2, lora_b=SCALING * dy2.t() @ (x2 @ a.t()))
    _assert_within(y, y_ref, x @ w.t() + SCALING * (x @ a.t()) @ b.t(), atol, rtol, "y")
    for name, grad in grads.items():
        assert grad.dtype == dtype, name
        _assert_within(grad, grads_ref[name], magnitudes[name], atol, rtol, f"d_{name}")


def _assert_within(actual, expected, magnitude, atol, rtol, what):
    excess = (actual.double() - expected).abs() - (atol + rtol * magnitude)
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    assert excess.max() <= 0, f"{what}: worst at {worst}: {float(actual[worst])} vs {float(expected[worst])}"


def test_the_sum_is_written_into_the_base_in_place():
    """No second [tokens, out] buffer: the adapter's GEMM accumulates into the projection's
    [tokens, out] output itself."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS[0] * ROWS[1], IN, generator=gen, requires_grad=True)
    weight = torch.randn(OUT, IN, generator=gen, requires_grad=True)
    lora_a = torch.randn(RANK, IN, generator=gen, requires_grad=True)
    lora_b = torch.randn(OUT, RANK, generator=gen, requires_grad=True)
    base = x @ weight.t()
    y = lora_linear(BACKEND, x, base, lora_a, lora_b, SCALING)
    assert y.data_ptr() == base.data_ptr()
    expected = (x @ weight.t() + (x @ lora_a.t() @ lora_b.t()) * SCALING).detach()
    torch.testing.assert_close(y.detach(), expected, rtol=1e-5, atol=1e-5)


def test_a_view_base_takes_the_sum_out_of_place():
    """A view (here of a 3-D output) is not written: torch would record CopySlices, whose backward
    copies the whole output gradient."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(*ROWS, IN, generator=gen, requires_grad=True)
    weight, lora_a = torch.randn(OUT, IN, generator=gen), torch.randn(RANK, IN, generator=gen, requires_grad=True)
    lora_b = torch.randn(OUT, RANK, generator=gen, requires_grad=True)
    base = x @ weight.t()
    y = lora_linear(BACKEND, x, base, lora_a, lora_b, SCALING)
    assert y.data_ptr() != base.data_ptr() and y.shape == base.shape
    torch.testing.assert_close(y.detach(), (base + (x @ lora_a.t() @ lora_b.t()) * SCALING).detach(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_harness_lora_projection_sums_in_place_with_the_out_of_place_results(fp8, monkeypatch):
    """FastDecoderLayer._linear on a [batch, seq, hidden] input (the LoraLinear op): the adapter's
    GEMM accumulates into the projection's own [tokens, out] output (aten addmm_, and no
    CopySlices node: a full copy of the output gradient in backward), over a 16-bit matmul's and
    the FP8 linear's alike, and the output and every gradient are those of the sum written out of
    place, bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from paddle_fastffn.core.fp8.recipe import Fp8Recipe
    from paddle_fastffn.torch import backend as torch_backend
    from paddle_fastffn.torch.llama import FastDecoderLayer, LoraSettings

    class AtenOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-6)
    hf_layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16)
    x0 = torch.randn(1, 32, 64, dtype=torch.bfloat16)
    dy = torch.randn(1, 32, 64, dtype=torch.bfloat16)

    def run():
        torch.manual_seed(1)
        layer = FastDecoderLayer(hf_layer, 4, 2, 1e-6, fp8_recipe=Fp8Recipe() if fp8 else None,
                                 lora=LoraSettings(rank=4))
        torch.nn.init.normal_(layer.lora_b["q"])  # B starts at zero: make the adapter count
        x = x0.clone().requires_grad_()
        with AtenOps() as ops:
            y = layer._linear(x, layer.w_q, "q")
        nodes, stack = [], [y.grad_fn]
        while stack:
            node = stack.pop()
            if node is not None:
                nodes.append(type(node).__name__)
                stack.extend(n for n, _ in node.next_functions)
        y.backward(dy)
        return ops.names, nodes, (y.detach(), x.grad, layer.lora_a["q"].grad, layer.lora_b["q"].grad)

    ops, nodes, in_place = run()
    assert "addmm_" in ops and "addmm" not in ops and "CopySlices" not in nodes, (ops, nodes)
    monkeypatch.setattr(torch_backend.TorchBackend, "linear_accumulate",
                        staticmethod(lambda base, x, weight, alpha: torch.addmm(base, x, weight.t(), alpha=alpha)))
    ops, _, out_of_place = run()
    assert "addmm" in ops and "addmm_" not in ops
    for name, a, b in zip(("y", "d_x", "d_lora_a", "d_lora_b"), in_place, out_of_place):
        assert torch.equal(a, b), name


NEEDS = {"all": dict(x=True, weight=True, lora_a=True, lora_b=True),
         "frozen_base": dict(x=True, weight=False, lora_a=True, lora_b=True),
         "x_without_gradient": dict(x=False, weight=False, lora_a=True, lora_b=True),
         "adapters_frozen": dict(x=True, weight=False, lora_a=False, lora_b=False)}


@pytest.mark.parametrize("needs", list(NEEDS.values()), ids=list(NEEDS))
def test_lora_linear_op_gives_the_gradients_asked_for_and_only_those(needs):
    """Every combination a LoRA step meets (a frozen base; layer 0's q/k/v with an x that needs no
    gradient; frozen adapters): the op's gradients against the stock formula in float64 (the
    element-wise bound of the fp32 row), None where none is asked for, on a 3-D x."""
    gen = torch.Generator().manual_seed(5)
    inputs = dict(x=torch.randn(*ROWS, IN, generator=gen), weight=torch.randn(OUT, IN, generator=gen) * IN**-0.5,
                  lora_a=torch.randn(RANK, IN, generator=gen) * IN**-0.5,
                  lora_b=torch.randn(OUT, RANK, generator=gen) * RANK**-0.5)
    dy = torch.randn(*ROWS, OUT, generator=gen)
    leaves = {name: t.clone().requires_grad_(needs[name]) for name, t in inputs.items()}
    y = fused_op(**leaves)
    assert y.grad_fn._forward_cls.__name__ == "LoraLinear", y.grad_fn
    y.backward(dy)
    ref = {name: t.double().requires_grad_() for name, t in inputs.items()}
    stock(**ref).backward(dy.double())
    x, w, a, b = (inputs[n].double().abs() for n in ("x", "weight", "lora_a", "lora_b"))
    g = dy.double().abs()
    x2, g2 = x.reshape(-1, IN), g.reshape(-1, OUT)
    magnitudes = dict(x=g @ w + SCALING * (g @ b) @ a, weight=g2.t() @ x2, lora_a=SCALING * (g2 @ b).t() @ x2,
                      lora_b=SCALING * g2.t() @ (x2 @ a.t()))
    atol, rtol = BY_NAME["float32"]
    for name, leaf in leaves.items():
        if not needs[name]:
            assert leaf.grad is None, name
            continue
        _assert_within(leaf.grad, ref[name].grad, magnitudes[name], atol, rtol, f"d_{name}")


@pytest.mark.parametrize("frozen", [False, True], ids=["cached_weight", "frozen_fp8_weight"])
@pytest.mark.parametrize("x_needs_grad", [True, False], ids=["x_grad", "no_x_grad"])
def test_lora_linear_op_over_an_fp8_base_matches_the_fp8_linear_plus_lora_linear(frozen, x_needs_grad):
    """The FP8 base inside the op (Fp8LinearOp on its own backend, core/lora.py Fp8Base) gives what
    the FP8 linear followed by lora_linear gives (autograd summing x's two gradients there), fp32
    activations on a 3-D x: the same FP8 quantisations, so equal up to the order of fp32
    roundings. The nested op's saved tensors live only in the framework's saving."""
    from paddle_fastffn.core.fp8.recipe import Fp8Recipe
    from paddle_fastffn.torch.fp8.linear import Fp8LinearState, fp8_linear, freeze_weight, fp8_base_of

    shape, width, out = (2, 16), 64, 48
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(*shape, width, generator=gen)
    w0 = torch.randn(out, width, generator=gen) * width**-0.5
    a0, b0 = torch.randn(RANK, width, generator=gen) * width**-0.5, torch.randn(out, RANK, generator=gen)
    dy = torch.randn(*shape, out, generator=gen)

    def run(in_op: bool):
        state = Fp8LinearState(Fp8Recipe(), device="cpu")
        x = x0.clone().requires_grad_(x_needs_grad)
        a, b = (t.clone().requires_grad_() for t in (a0, b0))
        weight = w0.clone().requires_grad_(not frozen)
        held = freeze_weight(weight, state) if frozen else weight
        if in_op:
            base_weight = None if frozen else weight
            y = ops.LoraLinear.apply(x, base_weight, None, a, b, SCALING, fp8_base_of(x, held, state))
            assert y.grad_fn._forward_cls.__name__ == "LoraLinear"
            assert y.grad_fn.fused_saved.inner.tensors == ()
        else:
            y = lora_linear(BACKEND, x, fp8_linear(x, held, state), a, b, SCALING)
        y.backward(dy)
        return [y.detach(), x.grad, a.grad, b.grad] + ([] if frozen else [weight.grad])

    # Element-wise bound of the fp32 row on the magnitude of the terms each result sums (the FP8
    # operands within 2^-3 of their unquantised values: 1.25 covers them): the two forms round the
    # same products in another order (an accumulating GEMM, with alpha inside, against autograd's sum).
    x, w, a, b, g = (t.double().abs().reshape(-1, t.shape[-1]) for t in (x0, w0, a0, b0, dy))
    magnitudes = dict(y=x @ w.t() + SCALING * (x @ a.t()) @ b.t(), d_x=g @ w + SCALING * (g @ b) @ a,
                      d_a=SCALING * (g @ b).t() @ x, d_b=SCALING * g.t() @ (x @ a.t()), d_weight=g.t() @ x)
    atol, rtol = BY_NAME["float32"]
    for name, got, want in zip(("y", "d_x", "d_a", "d_b", "d_weight"), run(True), run(False)):
        if name == "d_x" and not x_needs_grad:
            assert got is None and want is None
            continue
        _assert_within(got.reshape(-1, got.shape[-1]).double(), want.reshape(-1, want.shape[-1]).double(),
                       1.25 * magnitudes[name], atol, rtol, name)


def test_autocast_that_changes_the_gemm_dtype_keeps_lora_linear():
    """torch's autocast (here the CPU's, bf16) runs the GEMMs of fp32 tensors in bf16, inside a
    Function's forward too: fused_applies says no for fp32 tensors under it, yes for bf16 ones
    (what AMP O2's 16-bit model hands it) and for fp32 ones outside it."""
    from paddle_fastffn.core.lora import fused_applies

    x, w, a, b = (torch.randn(shape) for shape in ((4, 8), (6, 8), (2, 8), (6, 2)))
    assert fused_applies(BACKEND, x, x, w, None, a, b) and not BACKEND.autocast_changes_gemm(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert BACKEND.autocast_changes_gemm(x)
        assert not fused_applies(BACKEND, x, x, w, None, a, b)
        x16, w16, a16, b16 = (t.to(torch.bfloat16) for t in (x, w, a, b))
        assert fused_applies(BACKEND, x16, x16, w16, None, a16, b16)
