"""The harness's FP8 weight quantisations take their amax from the AdamW kernel (core/fp8/weight_cache.py
AmaxSlot): after each FusedMasterAdamW step the weight's next quantisation skips its amax pass, under both
weight_copies (a cached copy's, every forward's per use), and training is bit for bit the training in which
every quantisation takes the amax pass. Run on the CPU kernels here, on the GPU's by
tests/gpu/test_adamw_kernels.py."""

import pytest
import torch

from paddle_fastffn.core.fp8 import weight_cache as core_weight_cache
from paddle_fastffn.core.fp8.recipe import Fp8Recipe
from paddle_fastffn.torch.fp8.backend import TORCH
from paddle_fastffn.torch.fp8.linear import Fp8LinearState, fp8_linear
from paddle_fastffn.torch.llama import FusedMasterAdamW

SHAPE = (64, 128)  # the weight [out, in]; no activation or gradient of the test has this shape
STEPS = 3


def train(device: str, weight_copies: str):
    """(amax passes over the weight, its trained weight, an output after the last step)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(*SHAPE, device=device, dtype=torch.bfloat16) * 0.05)
    state = Fp8LinearState(Fp8Recipe(weight_copies=weight_copies), device=device)
    opt = FusedMasterAdamW([weight], lr=1e-2)
    passes = []
    quantize = TORCH.quantize

    def counting(x, *args, rowwise=True, transpose=True, **kwargs):
        if not rowwise and not transpose and tuple(x.shape) == SHAPE:
            passes.append(1)
        return quantize(x, *args, rowwise=rowwise, transpose=transpose, **kwargs)

    TORCH.quantize = counting
    try:
        for _ in range(STEPS):
            x = torch.randn(32, SHAPE[1], device=device, dtype=torch.bfloat16)
            fp8_linear(x, weight, state).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        y = fp8_linear(torch.ones(32, SHAPE[1], device=device, dtype=torch.bfloat16), weight, state)
    finally:
        del TORCH.quantize
    return len(passes), weight.detach().clone(), y.detach()


def check_quantisations_take_the_optimizers_amax(device: str, weight_copies: str) -> None:
    passes, *trained = train(device, weight_copies)
    original = core_weight_cache.amax_slot
    core_weight_cache.amax_slot = lambda weight: None  # every quantisation takes its amax pass
    try:
        reference_passes, *reference = train(device, weight_copies)
    finally:
        core_weight_cache.amax_slot = original
    # the first forward's pass only (before any optimizer step); without the slots one per forward
    assert (passes, reference_passes) == (1, STEPS + 1)
    for got, expected in zip(trained, reference):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("weight_copies", ["per_use", "cached"])
def test_quantisations_take_the_optimizers_amax_on_the_cpu(weight_copies):
    check_quantisations_take_the_optimizers_amax("cpu", weight_copies)
