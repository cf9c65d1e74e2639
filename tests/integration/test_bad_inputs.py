"""A new user's mistakes, one row each: scripts/run_finetune.py stops with one line naming the argument,
or the file and line, and what was expected, before it loads, downloads or writes anything.

Each row runs the script's main() in-process on a config the row breaks (the argument parser and the
checks run for real; no model loads, which is part of what is checked: the model folders here hold a
config.json only, so a load would fail with another message). One row runs the script as a user does,
a subprocess, to check the one-line form on stderr and the exit status. The FP8 fallback row trains
two steps of a tiny model to see the fallback stated in the last log line and run_summary.json."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOOD_LINE = {"src": "What is 1 plus 2?", "tgt": "1 plus 2 is 3."}
EXPECTED_FIELDS = "string fields 'src' and 'tgt'"


def load_script():
    spec = importlib.util.spec_from_file_location("run_finetune_under_test", REPO / "scripts" / "run_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A run folder as a user has it: model/ (a config.json: enough for every check, not for a load),
    data/train.json and dev.json, and config.json naming them with relative paths."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "data").mkdir()
    for name in ("train.json", "dev.json"):
        (tmp_path / "data" / name).write_text("\n".join(json.dumps(GOOD_LINE) for _ in range(8)) + "\n")
    write_config(tmp_path)
    return tmp_path


def write_config(folder: Path, **changes) -> Path:
    config = {"model_name_or_path": "model", "dataset_name_or_path": "data", "output_dir": "out", "device": "cpu",
              "use_fast_ffn": True, "max_steps": 2, "do_train": True, "do_eval": False, "report_to": "none"}
    config.update(changes)
    path = folder / "config.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def data_line(folder: Path, line_no: int, text: str, name: str = "train.json") -> None:
    path = folder / "data" / name
    lines = path.read_text().splitlines()
    lines[line_no - 1] = text
    path.write_text("\n".join(lines) + "\n")


# (id, how the row breaks the run folder, extra command-line arguments, the exact message)
CASES = [
    ("json_syntax", lambda d: data_line(d, 7, '{"src": "What is 1 plus 2?", "tgt": "1 plus 2 is\t3."}'), [],
     f"data/train.json:7:49: not valid JSON (Invalid control character at); each line is one JSON object with "
     f"{EXPECTED_FIELDS}"),
    ("json_truncated", lambda d: data_line(d, 3, '{"src": "What is 1 plus 2?", "tgt": "1 plus', "dev.json"), [],
     f"data/dev.json:3:37: not valid JSON (Unterminated string starting at); each line is one JSON object with "
     f"{EXPECTED_FIELDS}"),
    ("missing_field", lambda d: data_line(d, 7, '{"src": "What is 1 plus 2?", "answer": "3"}'), [],
     f"data/train.json:7: field 'tgt' missing; each line is one JSON object with {EXPECTED_FIELDS}"),
    ("field_type", lambda d: data_line(d, 2, '{"src": "What is 1 plus 2?", "tgt": 3}'), [],
     f"data/train.json:2:37: field 'tgt' is a number; expected {EXPECTED_FIELDS}"),
    ("not_an_object", lambda d: data_line(d, 5, '["What is 1 plus 2?", "3"]'), [],
     f"data/train.json:5:1: expected a JSON object with {EXPECTED_FIELDS}, got a list"),
    ("empty_data", lambda d: (d / "data" / "dev.json").write_text("\n"), [],
     f"data/dev.json: no examples (expected one JSON object with {EXPECTED_FIELDS} per line)"),
    ("no_dev_file", lambda d: (d / "data" / "dev.json").unlink(), [],
     "dataset_name_or_path='data': no dev.json there; expected train.json and dev.json, one JSON object with 'src' "
     "and 'tgt' per line"),
    ("model_typo", None, ["--model_name_or_path", "checkpoints/llama/final"],
     "model_name_or_path='checkpoints/llama/final': no such folder (relative to {cwd}); expected a checkpoint folder "
     "with config.json. Nothing was downloaded: a local-looking path is never looked up in the model store"),
    ("model_typo_first_folder_exists", None, ["--model_name_or_path", "data/llama-7b"],
     "model_name_or_path='data/llama-7b': no such folder (relative to {cwd}); expected a checkpoint folder with "
     "config.json. Nothing was downloaded: a local-looking path is never looked up in the model store"),
    ("model_folder_without_config", lambda d: (d / "model" / "config.json").unlink(), [],
     "model_name_or_path='model': no config.json in that folder; expected a checkpoint folder with config.json "
     "next to its weights"),
    ("resume_typo", None, ["--resume_from_checkpoint", "out/checkpoint-20"],
     "resume_from_checkpoint='out/checkpoint-20': no such folder (relative to {cwd}); expected a checkpoint-<step> "
     "folder that an earlier run wrote into its output_dir"),
    ("bad_boolean_in_json", lambda d: write_config(d, use_fast_ffn="maybe"), [],
     "use_fast_ffn in config.json: expected a boolean (true/false, yes/no, 1/0), got 'maybe'"),
    ("bad_integer_on_command_line", None, ["--max_steps", "ten"],
     "max_steps on the command line: expected an integer, got 'ten'"),
    ("bad_number", None, ["--learning_rate", "fast"],
     "learning_rate on the command line: expected a number, got 'fast'"),
    ("unknown_key", None, ["--use_fastffn", "true"],
     "unknown argument 'use_fastffn' on the command line: did you mean 'use_fast_ffn'? (or 'fuse_attention_ffn', "
     "'use_flash_attention') (the arguments are the fields of GenerateArgument, QuantArgument, ModelArgument, "
     "DataArgument, FinetuneTrainingArguments)"),
    ("config_syntax", lambda d: (d / "config.json").write_text('{"model_name_or_path": "model",\n "max_steps": 2,}'),
     [], "config.json:2:17: not valid JSON (Expecting property name enclosed in double quotes)"),
    ("fp8_on_cpu", None, ["--fast_ffn_precision", "fp8"],
     "fast_ffn_precision=fp8 needs an NVIDIA Hopper GPU (sm_90) and this Paddle build has no GPU: set "
     "fast_ffn_fp8_emulate=true for emulated FP8 (no speed-up), fast_ffn_fp8_fallback=bf16 to train in bf16 "
     "instead, or fast_ffn_precision=bf16"),
    ("fp8_scaling", None, ["--fast_ffn_fp8_scaling", "sometimes"],
     "fast_ffn_fp8_scaling must be one of ['current', 'delayed'], got 'sometimes'"),
    ("fp8_history", None, ["--fast_ffn_fp8_amax_history_len", "0"],
     "fast_ffn_fp8_amax_history_len must be >= 1, got 0"),
    ("fp8_fallback", None, ["--fast_ffn_fp8_fallback", "fp16"],
     "fast_ffn_fp8_fallback must be one of ['error', 'bf16'], got 'fp16'"),
    ("precision", None, ["--fast_ffn_precision", "fp4"],
     "fast_ffn_precision must be one of ['bf16', 'fp8'], got 'fp4'"),
]


@pytest.mark.parametrize("breaks, extra, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_each_mistake_is_one_line_before_any_work(script, workdir, breaks, extra, message):
    if breaks is not None:
        breaks(workdir)
    with pytest.raises(script.InputError) as caught:
        script.main(["config.json", *extra])
    assert str(caught.value) == message.format(cwd=workdir)
    assert "\n" not in str(caught.value)
    assert not (workdir / "out").exists()  # output_dir: nothing written


def test_the_script_as_a_user_runs_it_prints_one_line_and_exits_2(workdir):
    data_line(workdir, 7, '{"src": "What is 1 plus 2?", "tgt": "1 plus 2 is\t3."}')
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "run_finetune.py"), "config.json"],
                            capture_output=True, text=True, cwd=workdir, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 2, result.stderr[-3000:]
    # The whole output: no traceback, no usage text, no import warnings (a config with nothing for
    # PaddleNLP's TrainingArguments to remark on).
    assert result.stderr.splitlines() == [
        f"run_finetune.py: error: data/train.json:7:49: not valid JSON (Invalid control character at); "
        f"each line is one JSON object with {EXPECTED_FIELDS}"], result.stderr[-3000:]
    assert result.stdout == ""
    assert not (workdir / "out").exists()


def test_help_still_prints_the_usage(workdir):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "run_finetune.py"), "--help"],
                            capture_output=True, text=True, cwd=workdir, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0 and result.stdout.startswith("usage:") and "--fast_ffn_fp8_fallback" in result.stdout


def test_fp8_fallback_asked_for_is_stated_in_the_last_line_and_the_summary(script, tmp_path, monkeypatch, info_lines):
    from paddle_fastffn.finetune.demo_assets import build

    monkeypatch.chdir(tmp_path)
    demo = build(tmp_path / "demo", train=32, dev=4, vocab_size=400, hidden=64, layers=2)
    write_config(tmp_path, model_name_or_path=str(demo / "model"), dataset_name_or_path=str(demo / "data"),
                 per_device_train_batch_size=4, sample_prompts=0, disable_tqdm=True, logging_steps=1)
    summary = script.main(["config.json", "--fast_ffn_precision", "fp8", "--fast_ffn_fp8_fallback", "bf16"])
    reason = ("fast_ffn_precision=fp8 needs an NVIDIA Hopper GPU (sm_90) and this Paddle build has no GPU: "
              "training in bf16/fp32 (fast_ffn_fp8_fallback=bf16)")
    assert summary["fp8_fallback"] == reason and summary["global_steps"] == 2
    assert json.loads((tmp_path / "out" / "run_summary.json").read_text())["fp8_fallback"] == reason
    last = [line for line in info_lines if line.startswith("paddle_fastffn: run summary:")]
    assert len(last) == 1 and last[0].endswith(f"FP8 NOT USED: {reason}"), info_lines


@pytest.mark.parametrize("present", [False, True])
def test_a_test_run_says_in_its_first_lines_how_to_run_the_paddlenlp_client_tests(tmp_path, present):
    """Without shared/ the client tests skip; the header says so and how to run them, before any result."""
    shared = Path(os.environ.get("PADDLE_FASTFFN_SHARED", REPO.parent / "shared")) if present else tmp_path / "none"
    if present and not (shared / "clients" / "paddlenlp_llm_v2.8" / "llm" / "finetune_generation.py").is_file():
        pytest.skip(f"shared/ is not at {shared} on this machine")
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/integration/test_paddlenlp_client.py"], capture_output=True, text=True,
                            cwd=REPO, timeout=300, env=dict(os.environ, PADDLE_FASTFFN_SHARED=str(shared)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    head = result.stdout.splitlines()[:6]
    client = shared / "clients" / "paddlenlp_llm_v2.8" / "llm"
    expected = (f"PaddleNLP client script: {client} (tests/integration/test_paddlenlp_client.py runs it)" if present
                else f"PaddleNLP client script NOT FOUND at {client}: tests/integration/test_paddlenlp_client.py "
                     f"will be SKIPPED. To run them, put shared/ beside the checkout or set "
                     f"PADDLE_FASTFFN_SHARED=/path/to/shared")
    assert expected in head, head


@pytest.mark.parametrize("path, local", [
    ("meta-llama/Llama-2-7b", False), ("facebook/llama-7b", False), ("__internal_testing__/tiny-random-llama", False),
    ("llama-7b", False), ("./llama-7b", True), ("~/models/llama", True), ("/models/llama", True),
    ("checkpoints/llama/final", True), ("data/llama-7b", True), ("llama-7b/", True)])
def test_which_model_paths_count_as_local_folders(workdir, path, local):
    """A store name (org/name, or a bare name) is left to PaddleNLP's lookup; anything that can only be
    a folder here must exist (workdir has data/, not checkpoints/)."""
    from paddle_fastffn.finetune.input_checks import InputError, check_model_path, looks_local

    assert looks_local(path) is local
    if local:
        with pytest.raises(InputError, match=r"^model_name_or_path=.*: no such folder"):
            check_model_path("model_name_or_path", path)
    else:
        check_model_path("model_name_or_path", path)  # no error, nothing looked up
