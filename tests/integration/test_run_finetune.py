"""scripts/run_finetune.py end to end on a freshly built demo model, stock and fast, SFT and LoRA,
single process and a 2-process data-parallel launch (gloo on CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.distributed_launch import run_launch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from paddle_fastffn.finetune.demo_assets import build

    return build(tmp_path_factory.mktemp("demo"), train=256, dev=16, vocab_size=400, hidden=64, layers=2)


def run(demo, out, *extra, launch=False, steps=6):
    config = json.loads((REPO / "configs" / "demo_tiny_fast.json").read_text())
    config.update(model_name_or_path=str(demo / "model"), dataset_name_or_path=str(demo / "data"),
                  output_dir=str(out), max_steps=steps, logging_steps=1, per_device_train_batch_size=8,
                  disable_tqdm=True, sample_prompts=1, eval_steps=1000)
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(config))
    script = [str(REPO / "scripts" / "run_finetune.py"), str(path), *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    logs = ""
    if launch:
        result, worker_logs = run_launch(script, out.parent / f"{out.name}_logs", reset=(out,), env=env)
        logs = "\n".join(text[-3000:] for text in worker_logs.values())
    else:
        result = subprocess.run([sys.executable, *script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:] + logs
    return json.loads((out / "run_summary.json").read_text())


def losses(summary):
    return np.array([row["loss"] for row in summary["log_history"]])


def test_fast_and_stock_finetunes_match_step_by_step(demo, tmp_path):
    fast = run(demo, tmp_path / "fast")
    stock = run(demo, tmp_path / "stock", "--use_fast_ffn", "false")
    assert fast["use_fast_ffn"] and not stock["use_fast_ffn"]
    # The TrainingArguments enable the fast path and the script's apply_to_model sets the model's own
    # settings: the class-level patch is applied once per run.
    assert (fast["patch_applications"], stock["patch_applications"]) == (1, 0)
    assert (fast["optimizer"], stock["optimizer"]) == ("FastAdamW", "AdamW")  # fast_ffn_fused_optimizer's default
    assert len(losses(fast)) == 6
    # fp32 on CPU both ways; see test_checkpoints_and_convergence for the tolerance's reasoning.
    np.testing.assert_allclose(losses(fast), losses(stock), rtol=1e-4)
    assert fast["tokens_per_second"] > 0 and fast["peak_memory_mb"] > 0
    assert fast["samples"] and isinstance(fast["samples"][0]["answer"], str)
    assert (tmp_path / "fast" / "model_state.pdparams").exists()


def test_lora_finetune_on_the_fast_path(demo, tmp_path):
    fast = run(demo, tmp_path / "lora_fast", "--lora", "true", "--learning_rate", "0.01")
    stock = run(demo, tmp_path / "lora_stock", "--lora", "true", "--learning_rate", "0.01", "--use_fast_ffn", "false")
    np.testing.assert_allclose(losses(fast), losses(stock), rtol=1e-4)
    assert (tmp_path / "lora_fast" / "lora_model_state.pdparams").exists()


def test_data_parallel_launch_with_two_processes(demo, tmp_path):
    summary = run(demo, tmp_path / "dp", launch=True, steps=3)
    assert summary["global_steps"] == 3 and np.isfinite(losses(summary)).all()
    assert sorted(p.name for p in (tmp_path / "dp_logs").glob("workerlog.*")) == ["workerlog.0", "workerlog.1"]
