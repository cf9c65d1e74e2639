"""The one rule by which the GPU benchmark tables compare contenders (benchmarks/common.py): the
round-robin order, the summary of rounds, ties, and the best peer picked by measurement."""

import pytest

from benchmarks.common import (MIN_REPEATS, TIE_FLOOR, against_best_peer, best, compare, is_tie, percentiles,
                               rotated, summarize_rounds)


def row(samples):
    return percentiles(samples)


def test_rotation_puts_every_contender_in_every_position():
    names = ["ours", "hf_liger", "hf_eager"]
    orders = [rotated(names, r) for r in range(len(names))]
    assert orders == [["ours", "hf_liger", "hf_eager"], ["hf_liger", "hf_eager", "ours"],
                      ["hf_eager", "ours", "hf_liger"]]
    for position in range(len(names)):
        assert sorted(order[position] for order in orders) == sorted(names)
    assert rotated(names, 4) == orders[1] and rotated([], 2) == []


def test_spread_of_three_repeats_is_max_minus_min():
    r = row([10.0, 12.0, 11.0])
    assert (r["p50_ms"], r["spread_ms"], r["repeats"]) == (11.0, 2.0, 3)


def test_tie_within_the_larger_spread_and_not_beyond():
    ours, peer = row([100.0, 100.5, 104.0]), row([103.0, 103.5, 104.0])
    assert is_tie(ours, peer) and compare(ours, peer)["verdict"] == "tie"  # 3.0 apart, ours spread 4.0
    tight_ours, tight_peer = row([100.0, 100.1, 100.2]), row([103.0, 103.1, 103.2])
    result = compare(tight_ours, tight_peer)
    assert result["verdict"] == "faster" and result["speedup"] == pytest.approx(103.1 / 100.1)
    assert compare(tight_peer, tight_ours)["verdict"] == "slower"


def test_a_difference_under_the_floor_is_a_tie_even_with_no_spread():
    ours, peer = row([100.0] * MIN_REPEATS), row([100.0 * (1 + TIE_FLOOR / 2)] * MIN_REPEATS)
    assert compare(ours, peer)["verdict"] == "tie"
    peer = row([100.0 * (1 + 2 * TIE_FLOOR)] * MIN_REPEATS)
    assert compare(ours, peer)["verdict"] == "faster"


def test_rows_without_spread_use_p20_p80():
    old = {"p20_ms": 9.0, "p50_ms": 10.0, "p80_ms": 12.0}
    assert is_tie(old, {"p20_ms": 12.9, "p50_ms": 12.9, "p80_ms": 12.9})
    assert not is_tie(old, {"p20_ms": 13.1, "p50_ms": 13.1, "p80_ms": 13.1})


def test_best_peer_is_chosen_by_measured_median_and_skips_failed_rows():
    rows = {"ours": row([10.0, 10.1, 10.2]), "hf_liger": row([12.0, 12.1, 12.2]),
            "hf_torch_compile": row([9.0, 9.1, 9.2]), "liger_flce": {"error": "RuntimeError()"}}
    peers = ["hf_liger", "hf_torch_compile", "liger_flce", "absent"]
    assert best(rows, peers) == "hf_torch_compile"
    result = against_best_peer(rows, "ours", peers)
    assert result["peer"] == "hf_torch_compile" and result["verdict"] == "slower"
    assert against_best_peer(rows, "ours", ["liger_flce"]) is None
    assert against_best_peer({"hf_liger": rows["hf_liger"]}, "ours", ["hf_liger"]) is None


def test_rounds_summarised_per_metric():
    rounds = [{"step": 10.0, "optimizer": 2.0}, {"step": 12.0, "optimizer": 2.5}, {"step": 11.0}]
    summary = summarize_rounds(rounds)
    assert list(summary) == ["step", "optimizer"]
    assert summary["step"]["p50_ms"] == 11.0 and summary["step"]["spread_ms"] == 2.0
    assert summary["optimizer"]["repeats"] == 2
