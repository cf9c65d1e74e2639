"""CPU: stock PaddleFormers against `use_fast_ffn: true`, the same SFT run through PaddleFormers' own
launcher on the demo-size model (hidden 256, 4 layers) and the demo's data as erniekit jsonl, padded
rows and packed rows, OMP_NUM_THREADS threads, contenders round-robin, median of repeats.

    .pf-venv/bin/python -m benchmarks.cpu.bench_paddleformers --out benchmarks/results/cpu_paddleformers.json

Tokens/s is PaddleFormers' own interval_tokens_per_second_per_device (slot tokens of each step),
median over the steps after the first WARMUP of a run; the run's median is taken over repeats."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.cpu import paddleformers_assets as assets

REPO = Path(__file__).resolve().parents[2]
RATE = re.compile(r"interval_tokens_per_second_per_device: ([0-9.]+)")
LOSS = re.compile(r" - loss: ([0-9.]+),")
WARMUP = 3


def run(tmp: Path, data: Path, fast: bool, packing: bool, steps: int, threads: int) -> dict:
    name = f"{'fast' if fast else 'stock'}_{'packed' if packing else 'padded'}"
    values = dict(packing=packing, max_steps=steps, per_device_train_batch_size=4, max_seq_len=128)
    config = assets.sft_yaml(tmp / f"{name}.yaml", data, tmp / name, **(dict(values, use_fast_ffn=True) if fast else values))
    command = [sys.executable] + (["-m", "paddle_fastffn"] if fast else []) + [
        "-m", "paddleformers.cli.launcher", "train", str(config)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    out = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    if out.returncode:
        raise RuntimeError(log[-3000:])
    rates = [float(r) for r in RATE.findall(log)][WARMUP:]
    return {"tokens_per_s": statistics.median(rates), "losses": [float(x) for x in LOSS.findall(log)]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    options = parser.parse_args(argv)
    import paddle
    import paddleformers

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = assets.build(tmp / "assets", train=1024)
        for _ in range(options.repeats):
            for packing in (False, True):
                for fast in (False, True):
                    key = f"{'fast' if fast else 'stock'}_{'packed' if packing else 'padded'}"
                    results.setdefault(key, []).append(run(tmp, data, fast, packing, options.steps, options.threads))
    rows = {key: {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
                  "tokens_per_s_runs": [r["tokens_per_s"] for r in runs], "losses_first_run": runs[0]["losses"]}
            for key, runs in results.items()}
    for layout in ("padded", "packed"):
        rows[f"speedup_{layout}"] = rows[f"fast_{layout}"]["tokens_per_s_median"] / rows[f"stock_{layout}"]["tokens_per_s_median"]
    Path(options.out).write_text(json.dumps({
        "command": "python -m benchmarks.cpu.bench_paddleformers " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
                  f"OMP_NUM_THREADS={options.threads}",
        "versions": {"paddle": paddle.__version__, "paddleformers": paddleformers.__version__,
                     "python": platform.python_version()},
        "setup": {"model": assets.DEMO_SHAPE, "data": "demo examples as erniekit jsonl", "max_seq_len": 128,
                  "per_device_train_batch_size": 4, "steps": options.steps, "repeats": options.repeats,
                  "warmup_steps_dropped": WARMUP, "_attn_implementation": "sdpa",
                  "note": "stock's sdpa packing lets tokens attend across the examples of a row (docs/usage.md)"},
        "rows": rows}, indent=1))
    print(json.dumps({k: v for k, v in rows.items() if k.startswith("speedup")}))


if __name__ == "__main__":
    main()
