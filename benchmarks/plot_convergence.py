"""The loss curves of a convergence.json (benchmarks/gpu/convergence.py) as a PNG: training loss
(a moving mean, the raw per-step losses vary by batch) and held-out loss per run, and each run's
training loss relative to the reference's (bf16 on fp32 masters and moments) on the same batches.

    python -m benchmarks.plot_convergence benchmarks/results/runN/convergence.json --out curves.png \
        [--summary distances.json]

It also prints (and with --summary writes) how far each run's curves lie from the reference's
(`distances`): a single end point of one seed can sit on either side of the reference by chance, so
the mean distance over the whole run is what says which optimizer state tracks fp32 masters closest.

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


REFERENCE = "bf16"  # bf16 training on fp32 masters and moments: what every memory mode is measured against
DISTANCE_WINDOW = 100
END_STEPS = 100  # the harness's own end point: final_train_loss_last100


def distances(report: dict, window: int = DISTANCE_WINDOW, reference: str = REFERENCE) -> dict:
    """Per run, relative to the reference run on the same batches: the mean of |training-loss ratio - 1|
    (a moving mean of `window` steps first, the per-batch ratio is noisy) over the whole run and over
    its second half, the signed second-half mean (above 0: behind the reference), the mean |held-out
    ratio - 1| over the evaluations, and the end points (the last END_STEPS steps' mean training
    loss, the last held-out loss). A report without the reference run has no distances ({})."""
    if reference not in report["runs"]:
        return {}
    runs = report["runs"]
    base = runs[reference]
    base_train = np.asarray(base["train_loss"], dtype=np.float64)
    base_heldout = np.asarray([e["heldout_loss"] for e in base["heldout"]], dtype=np.float64)
    out = {}
    for name, run in runs.items():
        if name == reference:
            continue
        train = np.asarray(run["train_loss"], dtype=np.float64)
        heldout = np.asarray([e["heldout_loss"] for e in run["heldout"]], dtype=np.float64)
        if train.shape != base_train.shape or heldout.shape != base_heldout.shape:
            raise ValueError(f"run {name!r} has {train.size} steps and {heldout.size} evaluations where the reference "
                             f"{reference!r} has {base_train.size} and {base_heldout.size}: compare runs of one command")
        ratio = moving_mean(train / base_train - 1, window)
        second_half = ratio[len(ratio) // 2:]
        tail = min(END_STEPS, train.size)
        out[name] = {
            "train_mean_abs": float(np.mean(np.abs(ratio))),
            "train_second_half_mean_abs": float(np.mean(np.abs(second_half))),
            "train_second_half_mean": float(np.mean(second_half)),
            "heldout_mean_abs": float(np.mean(np.abs(heldout / base_heldout - 1))),
            "final_train": float(train[-tail:].mean() / base_train[-tail:].mean() - 1),
            "final_heldout": float(heldout[-1] / base_heldout[-1] - 1),
        }
    return out


def summary(report: dict, source: str, window: int = DISTANCE_WINDOW) -> dict:
    """What --summary writes: the distances with how they were measured."""
    steps = len(report["runs"][REFERENCE]["train_loss"]) if REFERENCE in report["runs"] else 0
    return {"source": source, "reference": REFERENCE, "train_window": window, "end_steps": min(END_STEPS, steps),
            "distances": distances(report, window)}


def distance_table(rows: dict, reference: str = REFERENCE) -> str:
    lines = [f"relative to {reference} on the same batches | train mean abs | 2nd half mean abs | 2nd half mean | "
             "held-out mean abs | final train | final held-out", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['train_mean_abs']:.2%} | {row['train_second_half_mean_abs']:.2%} | "
                     f"{row['train_second_half_mean']:+.2%} | {row['heldout_mean_abs']:.2%} | {row['final_train']:+.2%} | "
                     f"{row['final_heldout']:+.2%} |")
    return "\n".join(lines)


def plot(report: dict, out: str, window: int = 50, reference: str = REFERENCE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (train_ax, ratio_ax, heldout_ax) = plt.subplots(1, 3, figsize=(18, 5))
    base = np.asarray(runs[reference]["train_loss"]) if reference in runs else None
    for index, (name, run) in enumerate(runs.items()):
        color = f"C{index % 10}"  # one colour per run in every panel (the ratio panel has no reference line)
        curve = moving_mean(run["train_loss"], window)
        steps = np.arange(window, window + len(curve))
        train_ax.plot(steps, curve, label=name, linewidth=1, color=color)
        if base is not None and name != reference:
            ratio = moving_mean(np.asarray(run["train_loss"]) / base - 1, window) * 100
            ratio_ax.plot(steps, ratio, label=name, linewidth=1, color=color)
        heldout_ax.plot([e["step"] for e in run["heldout"]], [e["heldout_loss"] for e in run["heldout"]],
                        marker="o", label=name, color=color)
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
    parser.add_argument("--summary", help="write the distances to the reference as JSON here")
    args = parser.parse_args()
    with open(args.report) as f:
        report = json.load(f)
    plot(report, args.out, args.window)
    if REFERENCE not in report["runs"]:
        print(f"no {REFERENCE} run in {args.report}: no distances to it")
        return
    measured = summary(report, args.report)
    print(distance_table(measured["distances"]))
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(measured, f, indent=1)


if __name__ == "__main__":
    main()
