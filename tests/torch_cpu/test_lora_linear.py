"""core/lora.py's lora_linear over the harness's backend (TorchBackend.linear_accumulate: addmm
with alpha = scaling, in the storage dtype) against the stock formula x @ W^T + (x @ A^T @ B^T) *
scaling evaluated in float64 on the same inputs: the output and every gradient, fp32 and bf16
(the rows of the one tolerance table, tests/dtype_tolerances.py)."""

import pytest
import torch

from dtype_tolerances import BY_NAME
from paddle_fastffn.core.lora import lora_linear
from paddle_fastffn.torch.ops import BACKEND

ROWS, IN, OUT, RANK, SCALING = (3, 13), 45, 37, 6, 2.5


def _run(formula, inputs, dtype):
    leaves = {name: t.detach().to(dtype).requires_grad_() for name, t in inputs.items() if name != "dy"}
    y = formula(**leaves)
    y.backward(inputs["dy"].to(dtype))
    return y, {name: t.grad for name, t in leaves.items()}


def fused(x, weight, lora_a, lora_b):
    return lora_linear(BACKEND, x, x @ weight.t(), lora_a, lora_b, SCALING)


def stock(x, weight, lora_a, lora_b):
    return x @ weight.t() + (x @ lora_a.t() @ lora_b.t()) * SCALING


@pytest.mark.parametrize("rows", [ROWS, (ROWS[0] * ROWS[1],)], ids=["3d_view_base", "2d_in_place"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_and_every_gradient_match_the_stock_formula(dtype, rows):
    """A 3-D base reaches the sum as a view (out of place); a 2-D one takes it in place."""
    gen = torch.Generator().manual_seed(7)
    inputs = dict(x=torch.randn(*rows, IN, generator=gen), weight=torch.randn(OUT, IN, generator=gen) * IN**-0.5,
                  lora_a=torch.randn(RANK, IN, generator=gen) * IN**-0.5,
                  lora_b=torch.randn(OUT, RANK, generator=gen) * RANK**-0.5, dy=torch.randn(*rows, OUT, generator=gen))
    inputs = {name: t.to(dtype) for name, t in inputs.items()}  # the reference sees the same rounded values
    y, grads = _run(fused, inputs, dtype)
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
    """FastDecoderLayer._linear on a [batch, seq, hidden] input: the adapter's GEMM accumulates
    into the projection's own [tokens, out] output (aten addmm_, no CopySlices recorded: a full
    copy of the output gradient in backward), a 16-bit matmul's and the FP8 linear's alike, and
    the output and every gradient are those of the sum written out of place, bit for bit."""
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
