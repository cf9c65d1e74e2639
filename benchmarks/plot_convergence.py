"""The loss curves of a convergence.json (benchmarks/gpu/convergence.py) as a PNG: training loss
(a moving mean, the raw per-step losses vary by batch) and held-out loss per run, and each run's
training loss relative to the reference's (bf16 on fp32 masters and moments) on the same batches.

    python -m benchmarks.plot_convergence benchmarks/results/runN/convergence.json --out curves.png

Needs matplotlib (not a dependency of the package: the Paddle venv of scripts/setup_env.sh has it
through PaddleNLP)."""

from __future__ import annotations

import argparse
import json

import numpy as np


def moving_mean(values, window: int) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    window = max(1, min(window, len(values)))  # np.convolve swaps its operands for a longer window
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid")


def plot(report: dict, out: str, window: int = 50, reference: str = "bf16") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (train_ax, ratio_ax, heldout_ax) = plt.subplots(1, 3, figsize=(18, 5))
    base = np.asarray(runs[reference]["train_loss"]) if reference in runs else None
    for name, run in runs.items():
        curve = moving_mean(run["train_loss"], window)
        steps = np.arange(window, window + len(curve))
        train_ax.plot(steps, curve, label=name, linewidth=1)
        if base is not None and name != reference:
            ratio = moving_mean(np.asarray(run["train_loss"]) / base - 1, window) * 100
            ratio_ax.plot(steps, ratio, label=name, linewidth=1)
        heldout_ax.plot([e["step"] for e in run["heldout"]], [e["heldout_loss"] for e in run["heldout"]],
                        marker="o", label=name)
    train_ax.set(title=f"training loss (mean of {window} steps)", xlabel="step", yscale="log")
    ratio_ax.set(title=f"training loss vs {reference} on the same batches, % (mean of {window})", xlabel="step")
    ratio_ax.axhline(0, color="black", linewidth=0.5)
    heldout_ax.set(title="held-out loss", xlabel="step", yscale="log")
    for ax in (train_ax, ratio_ax, heldout_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    model = report.get("model", {})
    fig.suptitle(f"{model.get('parameters', 0) / 1e6:.0f}M LLaMA, {report['setup']['tokens_per_step']} tokens a step; "
                 f"{report['environment'].get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--out", required=True)
    parser.add_argument("--window", type=int, default=50)
    args = parser.parse_args()
    with open(args.report) as f:
        plot(json.load(f), args.out, args.window)


if __name__ == "__main__":
    main()
