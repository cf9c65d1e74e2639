"""A PaddleFormers user's run: `use_fast_ffn: true` added to the YAML of PaddleFormers' own launcher
(`python -m paddleformers.cli.launcher train x.yaml`, loaded with `python -m paddle_fastffn -m ...`)
trains the demo's data (erniekit jsonl) with the fast path, and its per-step losses are stock's;
checkpoints resume both ways between stock and fast runs."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.cpu import paddleformers_assets as assets
from tolerances import FAST_STOCK_TRAINING_LOSS_RTOL, FP8_TRAINING_LOSS_RTOL, FP32_TRAINING_LOSS_RTOL

REPO = Path(__file__).resolve().parents[2]
LOSS = re.compile(r" - loss: ([0-9.]+), .*global_step: (\d+),")
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    return assets.build(tmp_path_factory.mktemp("pf_assets"), train=64, **TINY)


def launch(tmp: Path, name: str, tiny, fast: bool, **overrides) -> dict:
    """Runs the launcher on a YAML; returns {"losses": {step: loss}, "log": text}."""
    output_dir = overrides.pop("output_dir", tmp / name)
    values = dict(overrides, use_fast_ffn=True) if fast else overrides
    config = assets.sft_yaml(tmp / f"{name}.yaml", tiny, output_dir, **values)
    command = ([sys.executable, "-m", "paddle_fastffn"] if fast else [sys.executable]) + [
        "-m", "paddleformers.cli.launcher", "train", str(config)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    return {"losses": {int(step): float(loss) for loss, step in LOSS.findall(log)}, "log": log}


def _assert_same_losses(fast: dict, stock: dict, rtol: float) -> None:
    assert fast.keys() == stock.keys() and stock, (fast, stock)
    steps = sorted(stock)
    f, s = np.array([fast[k] for k in steps]), np.array([stock[k] for k in steps])
    assert np.all(np.abs(f - s) <= rtol * np.abs(s)), (f.tolist(), s.tolist())


@pytest.mark.parametrize("mode", ["full", "packing", "lora"])
def test_sft_through_paddleformers_launcher_matches_stock(tmp_path, tiny_assets, mode):
    overrides = {"full": {}, "packing": {"packing": True}, "lora": {"fine_tuning": "LoRA", "lora": True,
                                                                      "lora_rank": 8}}[mode]
    # Packed rows: stock's reference is its eager attention. Its sdpa attention (the YAML's) builds the
    # examples' block mask and hands it to F.scaled_dot_product_attention with is_causal=True, which
    # Paddle 3.3.1 then ignores: every token also attends to the earlier examples of its row
    # (test_stock_sdpa_packing_attends_across_examples). The fast path keeps the examples apart.
    stock = launch(tmp_path, "stock", tiny_assets, False,
                   **dict(overrides, _attn_implementation="eager") if mode == "packing" else overrides)
    fast = launch(tmp_path, "fast", tiny_assets, True, **overrides)
    assert "paddle_fastffn" not in stock["log"]
    report = re.search(r"paddle_fastffn: (\d+)/(\d+) LLaMA decoder layers on the fast path", fast["log"])
    assert report and report.group(1) == report.group(2) == str(TINY["num_hidden_layers"]), fast["log"][-3000:]
    assert len(stock["losses"]) == 4
    _assert_same_losses(fast["losses"], stock["losses"], FP32_TRAINING_LOSS_RTOL)


def test_emulated_fp8_sft_through_paddleformers_launcher_stays_within_the_fp8_budget(tmp_path, tiny_assets):
    """`fast_ffn_precision: fp8` with `fast_ffn_fp8_emulate: true` in the YAML: every decoder projection
    computes in FP8 (emulated) in the launcher's process, and the per-step losses stay within the
    FP8 training budget of the same run in 16 bits (fp32 on CPU)."""
    bf16 = launch(tmp_path, "bf16", tiny_assets, True)
    fp8 = launch(tmp_path, "fp8", tiny_assets, True, fast_ffn_precision="fp8", fast_ffn_fp8_emulate=True)
    assert "fast_ffn_precision=fp8 runs emulated" in fp8["log"], fp8["log"][-3000:]
    assert "their linears run Fp8Linear each" in fp8["log"], fp8["log"][-3000:]  # attached in the forward
    assert "fast_ffn_precision=fp8" not in bf16["log"]
    _assert_same_losses(fp8["losses"], bf16["losses"], FP8_TRAINING_LOSS_RTOL)
    # FP8's rounding reached the losses (an FP8 option that changed nothing would pass the bound).
    assert any(fp8["losses"][k] != bf16["losses"][k] for k in bf16["losses"]), (fp8["losses"], bf16["losses"])


def test_launcher_under_paddle_distributed_launch_trains_on_the_fast_path(tmp_path, tiny_assets):
    """`python -m paddle_fastffn -m paddle.distributed.launch ... launcher.py train x.yaml`, what
    paddleformers-cli train runs: the launched process runs PaddleFormers' launcher script itself, so
    the plugin reaches it only through PYTHONPATH's sitecustomize (paddle_fastffn/_bootstrap); its
    YAML's use_fast_ffn is accepted there and trains on the fast path, as the same run started
    directly. One process: two CPU ranks fail in stock PaddleFormers 1.2.0 before training (its
    default sharding stage1 v2 asserts amp_master_grad, which needs bf16; without sharding its
    flex_checkpoint load reshards through Tensor.cuda(): "No available device found")."""
    direct = launch(tmp_path, "direct", tiny_assets, True)
    config = assets.sft_yaml(tmp_path / "launched.yaml", tiny_assets, tmp_path / "launched", use_fast_ffn=True)
    script = importlib.util.find_spec("paddleformers.cli.launcher").origin
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "paddle_fastffn", "-m", "paddle.distributed.launch", "--nproc_per_node",
                          "1", "--log_dir", str(tmp_path / "logs"), script, "train", str(config)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    log = (tmp_path / "logs" / "workerlog.0").read_text(errors="replace")
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:] + log[-3000:]
    report = re.search(r"paddle_fastffn: (\d+)/(\d+) LLaMA decoder layers on the fast path", log)
    assert report and report.group(1) == report.group(2) == str(TINY["num_hidden_layers"]), log[-3000:]
    losses = {int(step): float(loss) for loss, step in LOSS.findall(log)}
    _assert_same_losses(losses, direct["losses"], FP32_TRAINING_LOSS_RTOL)


def test_checkpoints_resume_both_ways_between_stock_and_fast(tmp_path, tiny_assets):
    """Four steps uninterrupted (stock), against two steps of one side saved and resumed by the other
    for the last two (PaddleFormers' Trainer finds checkpoint-2 in output_dir): weights and
    optimizer state load both ways."""
    # unified_checkpoint (safetensors weights and optimizer): PaddleFormers' default format
    # (flex_checkpoint) resumes only under fleet's hybrid-parallel group, which a single CPU process
    # does not set up ("'Fleet' object has no attribute '_hcg'", stock alone).
    save = dict(max_steps=4, save_strategy="steps", save_steps=2, overwrite_output_dir=False, unified_checkpoint=True,
                save_checkpoint_format="unified_checkpoint", load_checkpoint_format="unified_checkpoint")
    reference = launch(tmp_path, "reference", tiny_assets, False, **save)["losses"]
    for first, second in ((True, False), (False, True)):
        out = tmp_path / f"resume_{first}_{second}"
        launch(tmp_path, "first", tiny_assets, first, output_dir=out, **dict(save, max_steps=2))
        assert (out / "checkpoint-2").is_dir(), sorted(os.listdir(out))
        resumed = launch(tmp_path, "second", tiny_assets, second, output_dir=out, **save)
        assert "Checkpoint detected, resuming training" in resumed["log"], resumed["log"][-3000:]
        assert sorted(resumed["losses"]) == [3, 4], resumed["losses"]
        _assert_same_losses(resumed["losses"], {k: reference[k] for k in (3, 4)}, FAST_STOCK_TRAINING_LOSS_RTOL)
    saved = set(os.listdir(tmp_path / "resume_True_False" / "checkpoint-2"))
    assert {"model.safetensors.index.json", "optimizer.safetensors.index.json"} <= saved, saved


def test_stock_sdpa_packing_attends_across_examples():
    """Why the packed reference above is stock's eager attention: Paddle's SDPA ignores the mask it is
    given together with is_causal=True, which PaddleFormers' sdpa attention does for packed rows."""
    import paddle
    import paddle.nn.functional as F

    q = paddle.randn([1, 8, 2, 4])
    block_causal = np.tril(np.ones((8, 8), bool)) & np.kron(np.eye(2, dtype=bool), np.ones((4, 4), bool))
    mask = paddle.to_tensor(block_causal[None, None])
    with_mask = F.scaled_dot_product_attention(q, q, q, mask, 0.0, is_causal=True)
    plain_causal = F.scaled_dot_product_attention(q, q, q, None, 0.0, is_causal=True)
    np.testing.assert_array_equal(with_mask.numpy(), plain_causal.numpy())
