"""Every registered model family satisfies the contract of integration/family.py: it has the
ModelFamily members; apply() changes only the attributes it declares (patched_attributes), every one
of them where all options are on, and revert() restores each exactly; its fused layouts build, fuse,
split and save as declared."""

import numpy as np
import paddle
import pytest
from paddlenlp.transformers import AutoModelForCausalLM

from paddle_fastffn.integration import registry
from paddle_fastffn.integration.family import ModelFamily, missing_members
from paddle_fastffn.integration.fused_projections import FusedLayout, fast_fused_kinds, fast_fused_layers
from paddle_fastffn.integration.options import FastFFNOptions
from paddle_fastffn.integration.patching import own_attribute

FAMILIES = registry.registered_families()
ALL_ON_FP8 = FastFFNOptions(precision="fp8", fp8_emulate=True)  # every patch point of every family in use
OPTION_SETS = {
    "defaults": FastFFNOptions(),
    "all_off": FastFFNOptions(swiglu=False, rms_norm=False, rotary=False, attention=False, fuse_projections=False,
                              swiglu_recompute=False, fused_cross_entropy=False, fused_optimizer=False),
    "fp8_emulated": ALL_ON_FP8,
}


@pytest.fixture(autouse=True)
def _fast_path_off():
    registry.disable()
    yield
    registry.disable()


def _family_id(family):
    return family.__name__.rsplit(".", 1)[-1]


def _attributes(family) -> dict:
    """{(owner, name): what the owner itself holds} for every callable attribute of the family's
    modeling module and of the classes it defines: what a patch could change."""
    modeling = family.modeling_module()
    owners = [modeling] + [value for value in vars(modeling).values()
                           if isinstance(value, type) and value.__module__ == modeling.__name__]
    return {(owner, name): value for owner in owners for name, value in list(vars(owner).items())
            if callable(value) or isinstance(value, (staticmethod, classmethod))}


def _declared(pairs) -> set:
    return {(owner, name) for owner, name in pairs}


@pytest.mark.parametrize("family", FAMILIES, ids=_family_id)
def test_family_has_every_member_of_the_contract(family):
    assert not missing_members(family), missing_members(family)
    assert isinstance(family, ModelFamily)
    assert all(registry.family_for(model_type) is family for model_type in family.MODEL_TYPES)
    for owner, name in (*family.patched_attributes(), *family.hooked_attributes()):
        assert hasattr(owner, name), f"{_family_id(family)} declares {owner.__name__}.{name}, which does not exist"
    assert not _declared(family.patched_attributes()) & _declared(family.hooked_attributes())
    # Empty for a family PaddleNLP builds no fused projection for (Mixtral): nothing to fuse, split or save.
    assert isinstance(family.FUSED_LAYOUTS, dict)
    assert all(isinstance(layout, FusedLayout) for layout in family.FUSED_LAYOUTS.values())
    assert family.example_config().model_type in family.MODEL_TYPES


@pytest.mark.parametrize("options_name", sorted(OPTION_SETS))
@pytest.mark.parametrize("family", FAMILIES, ids=_family_id)
def test_apply_changes_only_what_it_declares_and_revert_restores_every_one(family, options_name):
    options = OPTION_SETS[options_name]
    family.install_hooks(registry.enabled_options)  # installed once, kept: not part of apply/revert
    declared = _declared(family.patched_attributes())
    before = _attributes(family)
    family.apply(options)
    try:
        applied = _attributes(family)
        changed = {key for key in before.keys() | applied.keys() if before.get(key) is not applied.get(key)}
        undeclared = {(getattr(owner, "__name__", owner), name) for owner, name in changed - declared}
        assert not undeclared, f"apply({options_name}) changed attributes it does not declare: {undeclared}"
        if options is ALL_ON_FP8:
            unused = {(getattr(owner, "__name__", owner), name) for owner, name in declared - changed}
            assert not unused, f"declared but not patched with every option on: {unused}"
    finally:
        family.revert()
    after = _attributes(family)
    assert after.keys() == before.keys()
    restored = [key for key in before if after[key] is not before[key]]
    assert not restored, f"revert left {[(getattr(o, '__name__', o), n) for o, n in restored]} changed"
    assert all(own_attribute(owner, name) is before.get((owner, name), own_attribute(owner, name))
               for owner, name in declared)


@pytest.mark.parametrize("family", FAMILIES, ids=_family_id)
def test_fused_layouts_build_split_fuse_and_save_as_declared(family):
    config = family.example_config()
    registry.enable(FastFFNOptions())
    paddle.seed(0)
    model = AutoModelForCausalLM.from_config(config)
    layers = family.decoder_layers(model)
    assert len(layers) == config.num_hidden_layers and family.patched_layer_count(model) == len(layers)
    assert fast_fused_kinds(model) == set(family.FUSED_LAYOUTS)
    state = model.state_dict()
    for owner_name, kind in fast_fused_layers(model).items():
        layout = family.FUSED_LAYOUTS[kind]
        owner = model
        for part in owner_name.split("."):
            owner = getattr(owner, part)
        assert getattr(owner, layout.config_flag) and not any(hasattr(owner, part) for part in layout.parts)
        weight = getattr(owner, layout.fused).weight
        assert f"{owner_name}.{layout.fused}.weight" in state
        # split_fn and fuse_fn are inverses, and the parts' widths add up to the fused weight.
        parts = family.split_fn(kind, config)(weight.detach())
        assert len(parts) == len(layout.parts) and sum(p.shape[-1] for p in parts) == weight.shape[-1]
        np.testing.assert_array_equal(family.fuse_fn(kind, config)(parts).numpy(), weight.numpy())
    # The stock checkpoint names the parts, never the fused layers, and says they are unfused.
    from paddle_fastffn.integration.fused_projections import saves_fused_layout, stock_checkpoint

    stock_state, stock_config = stock_checkpoint(model, state, model.config, saves_fused_layout(model.config),
                                                 family.FUSED_LAYOUTS)
    for owner_name, kind in fast_fused_layers(model).items():
        layout = family.FUSED_LAYOUTS[kind]
        assert f"{owner_name}.{layout.fused}.weight" not in stock_state
        assert all(f"{owner_name}.{part}.weight" in stock_state for part in layout.parts)
        assert getattr(stock_config, layout.config_flag) is False
