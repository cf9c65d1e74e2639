"""bench_gpu.round_robin_rebuilt, the loop of the whole-step and optimizer benchmarks: every round
builds every contender once in a rotated order, and each metric is summarised over the rounds.
The builders here stand for contenders and need no GPU (torch.cuda.empty_cache is a no-op before
CUDA is initialised); skipped where torch is not installed (the CPU CI: torch lives on the GPU
machine)."""

import pytest


@pytest.fixture
def round_robin_rebuilt():
    """Skips per test (not per module: a whole-suite run must collect every file, tests/conftest.py)."""
    pytest.importorskip("torch")
    from benchmarks.gpu.bench_gpu import round_robin_rebuilt

    return round_robin_rebuilt


def test_rounds_rotate_and_each_metric_is_summarised_over_rounds(round_robin_rebuilt):
    calls = []
    step_ms = {"ours": [10.0, 12.0, 11.0], "peer": [20.0, 21.0, 22.0]}

    def builder(name):
        def build():
            index = sum(1 for n in calls if n == name)
            calls.append(name)
            return {"step_ms": step_ms[name][index], "optimizer_ms": 1.0 + index, "peak_bytes": 7 + index}
        return build

    seen = []
    results = round_robin_rebuilt({"ours": builder("ours"), "peer": builder("peer")}, rounds=3,
                                  on_round=lambda name, index, row: seen.append((name, index)))
    assert calls == ["ours", "peer", "peer", "ours", "ours", "peer"]
    assert seen == [("ours", 0), ("peer", 0), ("peer", 1), ("ours", 1), ("ours", 2), ("peer", 2)]
    ours = results["ours"]
    assert ours["step"]["p50_ms"] == 11.0 and ours["step"]["spread_ms"] == 2.0 and ours["step"]["repeats"] == 3
    assert ours["optimizer"]["p50_ms"] == 2.0
    assert ours["peak_bytes"] == 7  # other fields: the first round's
    assert [r["step_ms"] for r in ours["rounds"]] == [10.0, 12.0, 11.0]


def test_fewer_rounds_than_the_minimum_are_raised_to_it_and_failures_are_kept(round_robin_rebuilt):
    attempts = {"flaky": 0}

    def flaky():
        attempts["flaky"] += 1
        if attempts["flaky"] == 2:
            raise RuntimeError("out of memory")
        return {"step_ms": 5.0}

    def broken():
        raise ValueError("no such contender")

    results = round_robin_rebuilt({"flaky": flaky, "broken": broken}, rounds=1)
    assert attempts["flaky"] == 2  # at least three rounds were planned; none after its failure
    assert results["flaky"]["step"]["repeats"] == 1
    assert "out of memory" in results["flaky"]["error_in_later_round"]["error"]
    assert results["broken"]["error"] == "ValueError('no such contender')" and results["broken"]["round"] == 0
