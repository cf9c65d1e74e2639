"""A frozen weight held only in FP8 (Fp8Recipe.frozen_weights "fp8" / "fp8_both", LoRA's base): the torch
binding's FrozenFp8Weight keeps only the copy its forward GEMM reads and backward transposes it
into the dgrad copy (or it keeps both copies); the result is the weight cache's path (both copies) bit for bit, and a LoRA
decoder layer built with it holds no 16-bit base weight on the device it computes on."""

import pytest
import torch

from paddle_fastffn.core.fp8.recipe import Fp8Recipe
from paddle_fastffn.torch.fp8.linear import Fp8LinearState, fp8_linear, freeze_weight


@pytest.mark.parametrize("both_copies", [False, True])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_frozen_weight_is_the_cached_paths_numerics(scaling, both_copies):
    torch.manual_seed(0)
    recipe = Fp8Recipe(scaling=scaling)
    weight = torch.randn(48, 32, dtype=torch.bfloat16)  # [out, in]
    held_state, cached_state = Fp8LinearState(recipe, "cpu"), Fp8LinearState(recipe, "cpu")
    frozen = freeze_weight(weight, held_state, both_copies)
    assert frozen.quantized.data is not None and (frozen.quantized.data_t is not None) == both_copies
    stored = [t for t in (frozen.quantized.data, frozen.quantized.data_t) if t is not None]
    assert frozen.nbytes() == sum(t.numel() * t.element_size() for t in stored) + 4 == len(stored) * 48 * 32 + 4
    for step in range(2):
        x = torch.randn(32, 32, dtype=torch.bfloat16)
        dy = torch.randn(32, 48, dtype=torch.bfloat16)
        results = []
        for held, state in ((frozen, held_state), (weight, cached_state)):
            xi = x.clone().requires_grad_(True)
            y = fp8_linear(xi, held, state)
            y.backward(dy)
            results.append((y.detach(), xi.grad))
        (y_held, dx_held), (y_cached, dx_cached) = results
        assert torch.equal(y_held, y_cached), f"step {step}: y"
        assert torch.equal(dx_held, dx_cached), f"step {step}: dx through the transposed forward copy"


def test_lora_layer_holds_its_bases_only_in_fp8():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from paddle_fastffn.torch.llama import UNFUSED_PROJECTIONS, FastDecoderLayer, LoraSettings

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-6)
    hf_layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16)
    layers = {mode: FastDecoderLayer(hf_layer, 4, 2, 1e-6, fp8_recipe=Fp8Recipe(frozen_weights=mode),
                                     lora=LoraSettings(rank=4)) for mode in ("fp8", "resident")}
    held = layers["fp8"]
    assert set(held.frozen_fp8) == {name for name, _, _ in UNFUSED_PROJECTIONS}
    assert layers["resident"].frozen_fp8 is None
    for name, attribute, path in UNFUSED_PROJECTIONS:
        weight = getattr(held, attribute)
        assert not weight.requires_grad
        assert torch.equal(weight, hf_layer.get_submodule(path).weight), f"{name}: the 16-bit copy keeps its values"
        assert weight.data_ptr() != getattr(layers["resident"], attribute).data_ptr()
