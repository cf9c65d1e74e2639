"""scripts/run_finetune.py's switches, in this process (main(argv) on the tiny demo model): every
shipped config starts training with the logger it names; resume from the last checkpoint in
output_dir; PaddleNLP's token accuracy for metric_for_best_model; seeded LoRA adapters; and the
errors for unknown arguments and for a checkpoint that cannot be resumed."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

import paddle_fastffn

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.json"))


def _load_script():
    spec = importlib.util.spec_from_file_location("run_finetune", REPO / "scripts" / "run_finetune.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


script = _load_script()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from paddle_fastffn.finetune.demo_assets import build

    return build(tmp_path_factory.mktemp("demo"), train=48, dev=6, vocab_size=400, hidden=64, layers=2)


def tiny(demo, out, **overrides):
    """Command-line overrides that fit a config to the demo model on this CPU: paths, sizes and
    what needs a GPU or several processes; everything else stays the config's own."""
    values = dict(model_name_or_path=demo / "model", dataset_name_or_path=demo / "data", output_dir=out,
                  device="cpu", dtype="float32", bf16="false", tensor_parallel_degree=1, sharding="",
                  sharding_parallel_degree=1, max_steps=1, per_device_train_batch_size=4,
                  per_device_eval_batch_size=4, gradient_accumulation_steps=1, max_length=48, src_length=24,
                  sample_prompts=0, disable_tqdm="true")
    values.update(overrides)
    return [f"--{key}={value}" for key, value in values.items()]


def run(argv):
    """main(argv) as a fresh process would run it: parameter names counted from 0, stock patches."""
    paddle_fastffn.revert_fast_ffn()
    with paddle.utils.unique_name.guard():
        return script.main([str(a) for a in argv])


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_each_shipped_config_trains_a_step_with_its_logger(config, demo, tmp_path):
    shipped = json.loads(config.read_text())
    summary = run([config, *tiny(demo, tmp_path / "out")])
    assert summary["global_steps"] == 1 and np.isfinite(summary["train_loss"])
    assert summary["use_fast_ffn"] == shipped["use_fast_ffn"]
    if shipped["report_to"] == "visualdl":  # its event file was written at train start
        assert list((tmp_path / "out" / "runs").rglob("vdlrecords.*.log")), "no VisualDL records"


def test_resume_from_the_last_checkpoint_in_output_dir_continues_exactly(demo, tmp_path):
    config = REPO / "configs" / "demo_tiny_fast.json"
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1, do_eval="false")
    full = run([config, *tiny(demo, tmp_path / "full", **common)])
    (tmp_path / "resumed").mkdir()
    first = run([config, *tiny(demo, tmp_path / "resumed", **{**common, "max_steps": 2})])
    assert (tmp_path / "resumed" / "checkpoint-2").is_dir() and first["global_steps"] == 2
    resumed = run([config, *tiny(demo, tmp_path / "resumed", **common)])  # finds checkpoint-2 itself
    full_losses = {row["step"]: row["loss"] for row in full["log_history"]}
    resumed_losses = {row["step"]: row["loss"] for row in resumed["log_history"]}
    assert sorted(resumed_losses) == [3, 4]
    assert all(resumed_losses[step] == full_losses[step] for step in (3, 4)), (resumed_losses, full_losses)
    # overwrite_output_dir trains from scratch instead
    again = run([config, *tiny(demo, tmp_path / "resumed", **common), "--overwrite_output_dir=true"])
    assert sorted(row["step"] for row in again["log_history"]) == [1, 2, 3, 4]


def test_accuracy_picks_the_best_model_at_end(demo, tmp_path):
    config = REPO / "configs" / "demo_tiny_fast.json"
    summary = run([config, *tiny(demo, tmp_path / "out", max_steps=4, evaluation_strategy="steps", eval_steps=2,
                                 save_strategy="steps", save_steps=2, metric_for_best_model="accuracy",
                                 load_best_model_at_end="true", learning_rate=0.01)])
    assert 0.0 <= summary["eval_accuracy"] <= 1.0
    state = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    evaluations = [row for row in state["log_history"] if "eval_accuracy" in row]
    assert [row["step"] for row in evaluations] == [2, 4]
    best = max(evaluations, key=lambda row: row["eval_accuracy"])
    assert state["best_metric"] == best["eval_accuracy"]
    assert state["best_model_checkpoint"].endswith(f"checkpoint-{best['step']}")


def test_token_accuracy_is_paddlenlp_llm_scripts():
    from paddle_fastffn.finetune.metrics import token_accuracy

    class Preds:
        predictions = np.array([[5, 6, 7, -100], [1, 2, 3, 4]])
        label_ids = np.array([[5, 0, 7, -100], [-100, 2, 9, 4]])

    assert token_accuracy(Preds) == {"accuracy": 4 / 6}  # llm/utils.py: accuracy over labels != -100


def test_lora_adapters_depend_on_the_seed_only(demo, tmp_path, monkeypatch):
    """Two identical runs get identical adapters, also where loading the model draws random numbers
    (here: one more draw, as a load path that initialises differently would)."""
    from paddle_fastffn.finetune import checkpoint

    config = REPO / "configs" / "demo_tiny_fast.json"
    argv = [config, *tiny(demo, tmp_path / "a", do_train="false", do_eval="false"), "--lora=true"]
    adapters = []
    for draws in (0, 1):
        load = checkpoint.load_model_and_tokenizer

        def load_drawing(*args, draws=draws, **kwargs):
            loaded = load(*args, **kwargs)
            paddle.rand([draws])
            return loaded

        monkeypatch.setattr(script, "load_model_and_tokenizer", load_drawing)
        captured = {}
        monkeypatch.setattr(script, "Trainer", _capture_model(captured))
        run(argv)
        adapters.append({n: p.numpy() for n, p in captured["model"].named_parameters() if "lora_A" in n})
    assert adapters[0] and adapters[0].keys() == adapters[1].keys()
    for name in adapters[0]:
        np.testing.assert_array_equal(adapters[0][name], adapters[1][name], err_msg=name)


def _capture_model(captured):
    from paddlenlp.trainer import Trainer

    class CapturingTrainer(Trainer):
        def __init__(self, model=None, **kwargs):
            captured["model"] = model
            super().__init__(model=model, **kwargs)

    return CapturingTrainer


@pytest.mark.parametrize("where", ["json", "command line"])
def test_an_unknown_argument_is_named_with_the_nearest_known_one(where, demo, tmp_path):
    config = json.loads((REPO / "configs" / "demo_tiny_fast.json").read_text())
    argv = []
    if where == "json":
        config["learning_rte"] = 0.1
    else:
        argv = ["--use_fastffn", "true"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        script.parse_arguments([str(path), *argv])
    message = str(error.value)
    if where == "json":
        assert "'learning_rte'" in message and str(path) in message and "did you mean 'learning_rate'" in message
    else:
        assert "'use_fastffn' on the command line" in message and "did you mean 'use_fast_ffn'" in message


def test_resume_from_a_missing_or_foreign_checkpoint_names_the_path_and_what_is_missing(demo, tmp_path):
    config = REPO / "configs" / "demo_tiny_fast.json"
    missing = tmp_path / "nowhere" / "checkpoint-7"
    # A folder that does not exist is an input error before any work (input_checks.check_inputs).
    with pytest.raises(ValueError, match=re.escape(f"resume_from_checkpoint='{missing}': no such folder")):
        run([config, *tiny(demo, tmp_path / "a"), f"--resume_from_checkpoint={missing}"])
    with pytest.raises(FileNotFoundError, match=r"is not a Trainer checkpoint: no trainer_state.json in it"):
        run([config, *tiny(demo, tmp_path / "b"), f"--resume_from_checkpoint={demo / 'model'}"])
    foreign = tmp_path / "foreign" / "checkpoint-1"
    foreign.mkdir(parents=True)
    (foreign / "trainer_state.json").write_text("{}")
    (foreign / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    with pytest.raises(ValueError, match=r"checkpoint of another model: \{field: \(checkpoint, this model\)\} = "
                                         r"\{'hidden_size': \(128, 64\)\}"):
        run([config, *tiny(demo, tmp_path / "c"), f"--resume_from_checkpoint={foreign}"])


@pytest.mark.parametrize("case, expected", [
    (dict(), True),  # use_fast_ffn alone: packed batches flatten
    (dict(use_fast_ffn=False), False),  # stock: PaddleNLP's dense-mask rows
    (dict(fast_ffn_attention=False), False),  # the segments become PaddleNLP's dense mask
    (dict(neftune=True), False),  # NEFTune's noise scale depends on the batch's shape
    (dict(rope_scaling_type="dynamic_ntk"), False),  # the rope table rescales past max_position_embeddings
    (dict(use_long_sequence_strategies=True), False),  # PaddleNLP's strategies (dynamic NTK among them)
    (dict(rope_scaling_type="linear"), True),  # position-only scalings see no row length
], ids=["fast", "stock", "attention_off", "neftune", "dynamic_ntk", "long_sequence_strategies", "linear_rope"])
def test_packed_batches_flatten_only_where_the_layout_cannot_change_training(case, expected):
    from types import SimpleNamespace

    args = SimpleNamespace(use_fast_ffn=case.get("use_fast_ffn", True),
                           fast_ffn_attention=case.get("fast_ffn_attention", True))
    config = SimpleNamespace(rope_scaling_type=case.get("rope_scaling_type"),
                             use_long_sequence_strategies=case.get("use_long_sequence_strategies", False))
    neftune = object() if case.get("neftune") else None
    assert script.flatten_packed_batches(args, config, neftune) is expected
