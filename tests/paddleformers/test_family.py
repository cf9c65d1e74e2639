"""PaddleFormers' LLaMA family in this environment: the registry serves it (and no PaddleNLP family),
it has every member of the family contract, apply() changes only LLaMA's own attributes it declares
(PaddleFormers' shared norm, MLP and loss registries untouched) and revert() restores each, and the
flag reaches PaddleFormers' TrainingArguments with errors that name the argument."""

import pytest

from paddle_fastffn.integration import paddleformers_llama as family
from paddle_fastffn.integration import fp8_attach, registry
from paddle_fastffn.integration.family import missing_members
from paddle_fastffn.integration.options import FastFFNOptions, OptionError


def _own_attributes(owners):
    return {(owner, name): value for owner in owners for name, value in list(vars(owner).items())}


def _shared_owners():
    from paddleformers.nn import mlp, norm
    from paddleformers.nn.attention.interface import AttentionInterface
    from paddleformers.nn.criterion.interface import LossInterface

    return [norm.RMSNorm, norm.Norm, mlp.MLP, AttentionInterface, LossInterface, norm, mlp]


def test_registry_serves_the_paddleformers_family_only():
    assert registry.registered_families() == [family]
    assert registry.family_for("llama") is family
    assert not missing_members(family), missing_members(family)


ALL_ON_FP8 = FastFFNOptions(precision="fp8", fp8_emulate=True)


@pytest.mark.parametrize("options", [FastFFNOptions(), FastFFNOptions(rms_norm=False, rotary=False), ALL_ON_FP8],
                         ids=["defaults", "norm_and_rotary_off", "fp8_emulated"])
def test_apply_changes_only_declared_llama_attributes_and_revert_restores_them(options):
    modeling = family.modeling_module()
    owners = [modeling] + [v for v in vars(modeling).values() if isinstance(v, type) and v.__module__ == modeling.__name__]
    before, shared_before = _own_attributes(owners), _own_attributes(_shared_owners())
    family.apply(options)
    try:
        changed = {k for k in before.keys() | _own_attributes(owners).keys()
                   if before.get(k) is not _own_attributes(owners).get(k)}
        assert changed <= set(family.patched_attributes()), changed - set(family.patched_attributes())
        assert (modeling.LlamaDecoderLayer, "forward") in changed
        if options is ALL_ON_FP8:
            assert changed == set(family.patched_attributes()), set(family.patched_attributes()) - changed
        shared_now = _own_attributes(_shared_owners())
        assert all(shared_now[k] is v for k, v in shared_before.items())
    finally:
        family.revert()
    after = _own_attributes(owners)
    assert [k for k in before if after.get(k) is not before[k]] == []


def test_layers_built_on_the_fast_path_run_stock_after_revert():
    import paddle

    from paddleformers.transformers import LlamaForCausalLM

    registry.enable(FastFFNOptions())
    paddle.seed(0)
    model = LlamaForCausalLM(family.example_config())
    assert family.patched_layer_count(model) == 2 and type(model.model.norm).__name__ == "FastRMSNorm"
    ids = paddle.arange(12, dtype="int64").reshape([2, 6])
    fast = model(ids)[0].numpy()
    registry.disable()
    assert family.patched_layer_count(model) == 0
    stock = model(ids)[0].numpy()
    assert abs(fast - stock).max() <= 1e-5 * abs(stock).max()


def test_training_arguments_take_the_flag_and_name_a_bad_value():
    from paddleformers.trainer import PdArgumentParser

    from paddle_fastffn import FastFFNTrainingArguments

    base = dict(output_dir="unused", device="cpu", amp_master_grad=False, report_to="none")
    args = PdArgumentParser((FastFFNTrainingArguments,)).parse_dict(dict(base, use_fast_ffn=True,
                                                                         fast_ffn_swiglu=False))[0]
    assert args.fast_ffn_options().swiglu is False and registry.enabled_options() is not None
    with pytest.raises(OptionError, match="fast_ffn_precision must be"):
        PdArgumentParser((FastFFNTrainingArguments,)).parse_dict(dict(base, use_fast_ffn=True, fast_ffn_precision="fp4"))
    # FP8 on a CPU without emulation stops before anything is patched, naming the ways on.
    with pytest.raises(fp8_attach.Fp8UnavailableError, match="fast_ffn_fp8_emulate=true"):
        PdArgumentParser((FastFFNTrainingArguments,)).parse_dict(dict(base, use_fast_ffn=True, fast_ffn_precision="fp8"))
    assert registry.enabled_options() is None or registry.enabled_options().precision != "fp8"
    args = PdArgumentParser((FastFFNTrainingArguments,)).parse_dict(dict(base, use_fast_ffn=True, fast_ffn_precision="fp8",
                                                                         fast_ffn_fp8_emulate=True,
                                                                         fast_ffn_fp8_scaling="current"))[0]
    assert family.fp8_recipe() == args.fast_ffn_options().fp8_recipe() and family.fp8_recipe().scaling == "current"


def test_the_launchers_parser_gets_the_fields_when_loaded_late():
    """plugin.extend_paddleformers_parser: a FinetuningArguments defined before the plugin was loaded
    (no fields) is replaced in the launcher's _TRAIN_ARGS by one with them."""
    from paddleformers.cli.hparams import parser

    from paddle_fastffn.integration.training_args import has_fast_ffn_fields
    from paddle_fastffn.plugin import extend_paddleformers_parser

    original = list(parser._TRAIN_ARGS)
    try:
        extend_paddleformers_parser(parser)
        finetuning = [cls for cls in parser._TRAIN_ARGS if cls.__name__ == "FinetuningArguments"]
        assert len(finetuning) == 1 and has_fast_ffn_fields(finetuning[0])
    finally:
        parser._TRAIN_ARGS[:] = original
