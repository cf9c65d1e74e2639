import json
import sys

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
