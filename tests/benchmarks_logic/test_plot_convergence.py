"""benchmarks/plot_convergence.py draws a convergence.json's runs (the reference first, memory modes
beside it) into a PNG."""

import json

import numpy as np
import pytest

from benchmarks import plot_convergence


def report(steps=120):
    rng = np.random.default_rng(0)
    base = 3.0 * np.exp(-np.arange(steps) / 60) + 1.0 + 0.05 * rng.random(steps)

    def run(offset):
        losses = (base * (1 + offset)).tolist()
        return {"train_loss": losses, "heldout": [{"step": s, "heldout_loss": losses[s - 1]} for s in (60, 120)]}

    return {"runs": {"bf16": run(0.0), "bf16+ours_int8_compensated": run(0.002), "bf16+torch_bf16": run(0.01)},
            "model": {"parameters": 104e6}, "setup": {"tokens_per_step": 8192}, "environment": {"device": "test"}}


def test_moving_mean_is_the_window_average():
    assert plot_convergence.moving_mean([1, 2, 3, 4], 2).tolist() == [1.5, 2.5, 3.5]
    assert plot_convergence.moving_mean([4, 3], 5).tolist() == [3.5]  # a run shorter than the window


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    source, out = tmp_path / "convergence.json", tmp_path / "curves.png"
    source.write_text(json.dumps(report()))
    import sys

    argv, sys.argv = sys.argv, ["plot_convergence", str(source), "--out", str(out), "--window", "10"]
    try:
        plot_convergence.main()
    finally:
        sys.argv = argv
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_distances_measure_each_run_against_the_reference_on_the_same_batches():
    rows = plot_convergence.distances(report(), window=10)
    assert set(rows) == {"bf16+ours_int8_compensated", "bf16+torch_bf16"}
    for name, offset in (("bf16+ours_int8_compensated", 0.002), ("bf16+torch_bf16", 0.01)):
        row = rows[name]
        for key in ("train_mean_abs", "train_second_half_mean_abs", "train_second_half_mean", "heldout_mean_abs",
                    "final_train", "final_heldout"):
            assert row[key] == pytest.approx(offset, rel=1e-9), (name, key)


def test_distances_average_magnitudes_where_a_run_crosses_the_reference():
    data = report()
    losses = np.asarray(data["runs"]["bf16"]["train_loss"])
    sign = np.where(np.arange(120) < 60, 1.0, -1.0)
    data["runs"]["bf16+torch_bf16"]["train_loss"] = (losses * (1 + 0.01 * sign)).tolist()
    row = plot_convergence.distances(data, window=1)["bf16+torch_bf16"]
    assert row["train_mean_abs"] == pytest.approx(0.01) and row["train_second_half_mean"] == pytest.approx(-0.01)


def test_distances_refuse_runs_of_different_lengths():
    data = report()
    data["runs"]["bf16+torch_bf16"]["train_loss"] = data["runs"]["bf16+torch_bf16"]["train_loss"][:-1]
    with pytest.raises(ValueError, match="bf16\\+torch_bf16"):
        plot_convergence.distances(data)


def test_distances_take_the_end_points_and_the_second_half_of_a_drifting_run():
    data = report(steps=400)
    losses = np.asarray(data["runs"]["bf16"]["train_loss"])
    drift = np.linspace(0.0, 0.02, 400)  # a run that falls behind the reference steadily
    data["runs"]["bf16+torch_bf16"]["train_loss"] = (losses * (1 + drift)).tolist()
    row = plot_convergence.distances(data, window=1)["bf16+torch_bf16"]
    tail = slice(400 - plot_convergence.END_STEPS, 400)
    expected_final = (losses[tail] * (1 + drift[tail])).mean() / losses[tail].mean() - 1
    assert row["final_train"] == pytest.approx(expected_final, rel=1e-12)
    assert row["train_second_half_mean"] == pytest.approx(drift[200:].mean(), rel=1e-12)
    assert row["train_mean_abs"] == pytest.approx(drift.mean(), rel=1e-12)
    # a wider window averages the ratio first: the same mean for a linear drift, minus its ends
    assert plot_convergence.distances(data, window=100)["bf16+torch_bf16"]["train_mean_abs"] == pytest.approx(
        drift.mean(), rel=1e-3)


def test_a_report_without_the_reference_has_no_distances_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    data = report()
    data["runs"] = {"fp8_delayed": data["runs"]["bf16+torch_bf16"]}
    source, summary_path = tmp_path / "convergence.json", tmp_path / "distances.json"
    source.write_text(json.dumps(data))
    import sys

    argv, sys.argv = sys.argv, ["plot_convergence", str(source), "--out", str(tmp_path / "c.png"),
                                "--summary", str(summary_path)]
    try:
        plot_convergence.main()
    finally:
        sys.argv = argv
    assert plot_convergence.distances(data) == {}
    assert "no bf16 run" in capsys.readouterr().out and not summary_path.exists()


def test_the_summary_and_the_report_table_render_the_distances(tmp_path):
    from benchmarks import report_tables

    data = report()
    data["runs"]["bf16+torch_bf16"].update(optimizer="torch_bf16", seconds=57.0)
    data["runs"]["bf16+ours_int8_compensated"].update(optimizer="ours_int8_compensated", seconds=52.0)
    data["runs"]["bf16"]["seconds"] = 42.0
    data.update(command="python3 -m benchmarks.gpu.convergence --out c.json", environment={"device": "test", "date": "d"},
                setup={"tokens_per_step": 8192, "optimizer": "AdamW",
                       "optimizers": {"torch_bf16": "no master, bf16 moments"}})
    measured = plot_convergence.summary(data, "c.json", window=10)
    assert measured["train_window"] == 10 and measured["end_steps"] == plot_convergence.END_STEPS
    out = []
    report_tables.convergence_section(out, measured, data)
    text = "\n".join(out)
    assert "| bf16+torch_bf16 | no master, bf16 moments | 1.00% |" in text
    assert "| bf16+ours_int8_compensated | ours_int8_compensated | 0.20% |" in text  # no description: its name
    assert "moving mean of 10 steps" in text and "104M LLaMA" in text
