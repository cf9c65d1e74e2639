"""Shared benchmark plumbing: environment record, percentiles, results file."""

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

    return {"p20_ms": at(0.2), "p50_ms": at(0.5), "p80_ms": at(0.8), "repeats": len(ordered)}


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
