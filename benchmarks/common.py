"""Shared benchmark plumbing: environment record, percentiles, results file, and the one rule by
which every GPU table compares contenders (medians, spreads, ties, the best peer)."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import subprocess
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"p20_ms": at(0.2), "p50_ms": at(0.5), "p80_ms": at(0.8), "repeats": len(ordered),
            "spread_ms": at(0.8) - at(0.2)}


# --- Comparing contenders ------------------------------------------------------------------------
# Every GPU table is timed round-robin (benchmarks/gpu/bench_gpu.round_robin): each repeat runs every
# contender once, in an order rotated by one per repeat, at least MIN_REPEATS times. A contender's
# figure is the median of its repeats; its spread is p80 - p20 of them (max - min for 3-5 repeats).
MIN_REPEATS = 3
# Decoder-layer wins of ~1% flipped sign between four H200 runs while each run's own spread was
# smaller: a difference under 1% is not a result, whatever one run's spread says.
TIE_FLOOR = 0.01
TIE_RULE = (f"Two contenders tie when their medians differ by no more than the larger of their two spreads "
            f"(p80 - p20 of the round-robin repeats, max - min for 3-5 repeats) or by less than "
            f"{TIE_FLOOR:.0%} of the larger median (wins of ~1% flipped between H200 runs 11-14).")


def rotated(names: list, repeat: int) -> list:
    """The order of one round-robin repeat: `names` rotated left by `repeat`, so over len(names)
    repeats each contender runs once in every position (first after a flush, last, ...)."""
    shift = repeat % len(names) if names else 0
    return names[shift:] + names[:shift]


def summarize_rounds(rounds: list[dict]) -> dict:
    """Per-round measurements of one contender ([{metric: ms}, ...], one dict per round-robin round)
    -> {metric: percentiles over the rounds}. A metric missing from a round is left out of it."""
    metrics = dict.fromkeys(key for r in rounds for key in r)
    return {key: percentiles([r[key] for r in rounds if key in r]) for key in metrics}


def spread_ms(row: dict) -> float:
    """A timing row's spread; rows written before spread_ms existed have p20/p80."""
    return row["spread_ms"] if "spread_ms" in row else row["p80_ms"] - row["p20_ms"]


def timed(row) -> bool:
    return isinstance(row, dict) and "p50_ms" in row


def is_tie(a: dict, b: dict) -> bool:
    """TIE_RULE for two timing rows (dicts with p50_ms and a spread)."""
    difference = abs(a["p50_ms"] - b["p50_ms"])
    return difference <= max(spread_ms(a), spread_ms(b)) or difference < TIE_FLOOR * max(a["p50_ms"], b["p50_ms"])


def best(rows: dict, names) -> str | None:
    """The name among `names` whose row has the lowest median (rows without a timing are skipped)."""
    candidates = [n for n in names if timed(rows.get(n))]
    return min(candidates, key=lambda n: rows[n]["p50_ms"]) if candidates else None


def compare(ours: dict, peer: dict) -> dict:
    """ours against one peer: speedup (peer median / ours; > 1: ours faster) and the verdict,
    'tie' under TIE_RULE, otherwise 'faster' or 'slower' (ours)."""
    speedup = peer["p50_ms"] / ours["p50_ms"]
    verdict = "tie" if is_tie(ours, peer) else ("faster" if speedup > 1 else "slower")
    return {"speedup": speedup, "verdict": verdict}


def against_best_peer(rows: dict, ours: str, peers) -> dict | None:
    """ours against the fastest of `peers` by measured median (never a peer chosen in advance):
    {"peer", "speedup", "verdict"}, or None when ours or every peer lacks a timing."""
    peer = best(rows, peers)
    if peer is None or not timed(rows.get(ours)):
        return None
    return {"peer": peer, **compare(rows[ours], rows[peer])}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def write_results(name: str, payload: dict, results_dir: Path = RESULTS_DIR) -> Path:
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "git_commit": git_commit(),
        **payload,
    }
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# Loss spikes of a training run against a reference run on the same batches (benchmarks/gpu/convergence.py).
SPIKE_RATIO, SPIKE_AFTER = 1.10, 200  # loss / reference loss above which a step is a spike; warm-up steps


def same_batch_spikes(losses, bf16_losses):
    """Steps after warm-up where this run's loss exceeds bf16's on the same batch by SPIKE_RATIO,
    and the largest ratio seen."""
    ratios = [a / b for a, b in zip(losses, bf16_losses)][SPIKE_AFTER:]
    found = [{"step": SPIKE_AFTER + i, "ratio": r} for i, r in enumerate(ratios) if r > SPIKE_RATIO]
    return {"steps": found, "max_ratio": max(ratios) if ratios else None,
            "max_ratio_step": SPIKE_AFTER + ratios.index(max(ratios)) if ratios else None}
