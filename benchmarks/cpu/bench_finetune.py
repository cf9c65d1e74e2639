"""CPU fine-tune benchmark: the embedded demo model fine-tuned on the stock PaddleNLP path and
with use_fast_ffn=True, same data, same steps, alternating stock/fast `--repeats` times in this
run (a shared 2-core machine drifts by 10% between runs; the fastest run of each side is the
least disturbed one); per-step losses, step time, tokens/s and peak process memory (RSS).

    python -m benchmarks.cpu.bench_finetune [--steps 120] [--repeats 2] [--results-dir DIR]

Writes DIR/cpu_finetune_demo.json (default benchmarks/results, the committed results; the demo
writes to output/ so that it never overwrites them). Paddle CPU runs float32 (its AMP is a no-op).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import RESULTS_DIR, cpu_model, write_results

REPO = Path(__file__).resolve().parents[2]


def run(config: str, steps: int, out: Path) -> dict:
    cmd = [sys.executable, str(REPO / "scripts" / "run_finetune.py"), str(REPO / "configs" / config),
           "--max_steps", str(steps), "--output_dir", str(out), "--logging_steps", "10", "--eval_steps", "100000"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # Output streams through (progress bars, the logged loss, tokens/s and memory).
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    return json.loads((out / "run_summary.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    all_runs = {"stock": [], "fast": []}
    for _ in range(args.repeats):
        for name, config in (("stock", "demo_tiny_stock.json"), ("fast", "demo_tiny_fast.json")):
            all_runs[name].append(run(config, args.steps, REPO / "output" / f"demo_tiny_{name}"))
    runs = {name: min(results, key=lambda r: r["step_time_ms"]) for name, results in all_runs.items()}
    stock, fast = runs["stock"], runs["fast"]
    losses = {n: [row["loss"] for row in r["log_history"]] for n, r in runs.items()}
    print("\nstep   stock loss   fast loss")
    for row_s, row_f in zip(stock["log_history"], fast["log_history"]):
        print(f"{row_s['step']:4d}   {row_s['loss']:10.4f}   {row_f['loss']:9.4f}")
    print(f"\n{'':22s}{'stock':>12s}{'fast':>12s}{'fast/stock':>12s}")
    for key, label in (("step_time_ms", "step time (ms)"), ("tokens_per_second", "tokens/s"),
                       ("peak_memory_mb", "peak RSS (MiB)"), ("eval_loss", "eval loss")):
        print(f"{label:22s}{stock[key]:12.2f}{fast[key]:12.2f}{fast[key] / stock[key]:12.3f}")
    for sample in fast.get("samples", []):
        print(f"fast-path answer: {sample['prompt']!r} -> {sample['answer']!r} (reference {sample['expected']!r})")
    import paddle
    import paddlenlp

    path = write_results("cpu_finetune_demo", {
        "device": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "versions": {"paddle": paddle.__version__, "paddlenlp": paddlenlp.__version__},
        "what": "embedded demo LLaMA-2-architecture model (hidden 256, 4 layers, GQA 8/4 heads), float32 on CPU",
        "steps": args.steps, "repeats": args.repeats,
        "step_time_ms_every_run": {n: [r["step_time_ms"] for r in rs] for n, rs in all_runs.items()},
        "stock": {k: stock[k] for k in ("step_time_ms", "tokens_per_second", "peak_memory_mb", "eval_loss", "train_loss")},
        "fast": {k: fast[k] for k in ("step_time_ms", "tokens_per_second", "peak_memory_mb", "eval_loss", "train_loss")},
        "speedup_step_time": stock["step_time_ms"] / fast["step_time_ms"],
        "memory_ratio": fast["peak_memory_mb"] / stock["peak_memory_mb"],
        "losses": losses, "fast_samples": fast.get("samples", [])}, results_dir=args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
