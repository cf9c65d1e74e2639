import json
import sys
from pathlib import Path

from paddlenlp.trainer import PdArgumentParser

import paddle_fastffn
from paddle_fastffn.integration import enabled_options


def _parse(argv, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["run_finetune.py", *argv])
    parser = PdArgumentParser((paddle_fastffn.FastFFNTrainingArguments,))
    return parser.parse_json_file_and_cmd_lines()[0] if argv[0].endswith(".json") else parser.parse_args_into_dataclasses()[0]


def test_flag_parses_from_json_and_command_line_overrides_it(tmp_path, monkeypatch):
    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path), "use_fast_ffn": True,
                                  "fast_ffn_swiglu_recompute": True}))
    args = _parse([str(config)], tmp_path, monkeypatch)
    assert args.use_fast_ffn and args.fast_ffn_swiglu_recompute
    assert enabled_options() == args.fast_ffn_options()  # patched as the arguments are built
    paddle_fastffn.revert_fast_ffn()
    args = _parse([str(config), "--use_fast_ffn", "false", "--fast_ffn_rotary", "false"], tmp_path, monkeypatch)
    assert not args.use_fast_ffn and not args.fast_ffn_rotary
    assert enabled_options() is None


def test_flag_defaults_off(tmp_path, monkeypatch):
    args = _parse(["--output_dir", str(tmp_path)], tmp_path, monkeypatch)
    assert args.use_fast_ffn is False and enabled_options() is None


def test_use_fast_ffn_alone_is_the_benchmarked_path(tmp_path, monkeypatch):
    args = _parse(["--output_dir", str(tmp_path), "--use_fast_ffn", "true"], tmp_path, monkeypatch)
    options = args.fast_ffn_options()
    assert options.fuse_projections and options.swiglu_recompute and not options.save_fused_checkpoint
    assert enabled_options() == options
    paddle_fastffn.revert_fast_ffn()
    args = _parse(["--output_dir", str(tmp_path), "--use_fast_ffn", "true", "--fast_ffn_fuse_projections", "false",
                   "--fast_ffn_swiglu_recompute", "false", "--fast_ffn_save_fused_checkpoint", "true"],
                  tmp_path, monkeypatch)
    options = args.fast_ffn_options()
    assert not options.fuse_projections and not options.swiglu_recompute and options.save_fused_checkpoint


def test_unified_checkpoint_keeps_projections_unfused_unless_the_fused_layout_is_asked_for(tmp_path, monkeypatch):
    # unified_checkpoint saves model.state_dict() as it is (not through save_pretrained's split).
    base = ["--output_dir", str(tmp_path), "--use_fast_ffn", "true", "--unified_checkpoint", "true"]
    assert not _parse(base, tmp_path, monkeypatch).fast_ffn_options().fuse_projections
    assert not enabled_options().fuse_projections
    paddle_fastffn.revert_fast_ffn()
    args = _parse(base + ["--fast_ffn_save_fused_checkpoint", "true"], tmp_path, monkeypatch)
    assert args.fast_ffn_options().fuse_projections


def test_each_fast_config_differs_from_its_stock_twin_only_in_the_flag_and_output_dir():
    configs = Path(__file__).resolve().parents[2] / "configs"
    pairs = sorted(configs.glob("*_fast.json"))
    assert pairs
    for fast_file in pairs:
        fast = json.loads(fast_file.read_text())
        stock = json.loads(fast_file.with_name(fast_file.name.replace("_fast.json", "_stock.json")).read_text())
        differ = {k for k in fast.keys() | stock.keys() if fast.get(k) != stock.get(k)}
        assert differ == {"use_fast_ffn", "output_dir"}, fast_file.name
        assert fast["use_fast_ffn"] is True and stock["use_fast_ffn"] is False


def test_fused_cross_entropy_is_on_by_default_and_switchable(tmp_path, monkeypatch):
    args = _parse(["--output_dir", str(tmp_path), "--use_fast_ffn", "true"], tmp_path, monkeypatch)
    assert args.fast_ffn_fused_cross_entropy and args.fast_ffn_options().fused_cross_entropy
    assert enabled_options().fused_cross_entropy
    paddle_fastffn.revert_fast_ffn()
    args = _parse(["--output_dir", str(tmp_path), "--use_fast_ffn", "true", "--fast_ffn_fused_cross_entropy", "false"],
                  tmp_path, monkeypatch)
    assert not args.fast_ffn_options().fused_cross_entropy and not enabled_options().fused_cross_entropy


def test_every_option_is_declared_once_and_each_entry_point_takes_it_as_declared():
    """FastFFNOptions declares the options; the TrainingArguments fields are made from it, and
    apply_fast_ffn_to_llama (which imports nothing Paddle, so spells its keywords out) takes the same
    names with the same defaults: its named keywords, and the fp8_* recipe fields through **fp8_options."""
    import dataclasses
    import inspect

    from paddle_fastffn.integration.options import FastFFNOptions, option_defaults

    declared = option_defaults()
    fields = {f.name: f for f in dataclasses.fields(paddle_fastffn.FastFFNTrainingArguments)}
    for name, default in declared.items():
        field = fields[f"fast_ffn_{name}"]
        option = next(f for f in dataclasses.fields(FastFFNOptions) if f.name == name)
        assert (field.default, field.metadata["help"]) == (default, option.metadata["help"]), name
    assert {n for n in fields if n.startswith("fast_ffn_")} == {f"fast_ffn_{n}" for n in declared}
    parameters = inspect.signature(paddle_fastffn.apply_fast_ffn_to_llama).parameters
    named = {n: p.default for n, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD and n != "model"}
    assert named == {n: d for n, d in declared.items() if not n.startswith("fp8_")}
    assert [p.kind for p in parameters.values()][-1] is inspect.Parameter.VAR_KEYWORD
    assert all(f.metadata.get("help") for f in dataclasses.fields(FastFFNOptions))
