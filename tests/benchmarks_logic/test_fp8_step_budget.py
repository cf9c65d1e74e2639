"""benchmarks/fp8_step_budget.py against the committed measurements it reads: its GEMM split must account for
every GEMM kernel of each profiled step, its FP8 GEMM rate must lie between the card's bf16 GEMM ceiling and
FP8's twice that, its cast bytes must give every cast kernel a rate the card can reach, and what it says is left
to win must come out of parts of the measured step."""

import json

import pytest

from benchmarks import fp8_step_budget
from benchmarks.common import RESULTS_DIR


@pytest.fixture(scope="module")
def budget(tmp_path_factory):
    out = fp8_step_budget.main(["--out", str(tmp_path_factory.mktemp("budget") / "fp8_step_budget.json")])
    return json.loads(out.read_text())


def test_the_gemm_split_accounts_for_every_gemm_kernel(budget):
    steps = budget["profiled_steps_7b"]
    for name, step in steps.items():
        assert step["fp8_gemm_ms"] > 0
        assert step["fp8_gemm_ms"] + step["sixteen_bit_gemm_ms"] == pytest.approx(step["kernel_ms_by_category"]["gemm"])
    # forward (4 per layer) and dgrad + wgrad (8 per layer) of the four projections, 8 layers; the FP8 head's 3
    assert steps["ours_fp8_delayed"]["fp8_gemm_calls"] == 12 * 8
    assert steps["ours_fp8_delayed_fp8_head"]["fp8_gemm_calls"] == 12 * 8 + 3
    assert steps["ours_fp8_delayed_fp8_head"]["sixteen_bit_gemm_ms"] == pytest.approx(0, abs=0.05)


def test_rates_lie_within_the_cards_ceilings(budget):
    bf16_ceiling = budget["inputs"]["ceilings_used"]["bf16_gemm_tflops"]
    for step in budget["profiled_steps_7b"].values():
        assert bf16_ceiling < step["fp8_gemm_tflops"] < 2 * bf16_ceiling
        for cast in step["casts"].values():
            # the modelled bytes move at a rate a memory-bound kernel reaches, near the copy's: a byte a modelled
            # element too few or too many in any part moves a kind's rate out of this band
            assert 0.85 < cast["fraction_of_copy"] <= 1.0
    # the bf16 LM head's GEMMs run near the bf16 ceiling: run 21's profile against run 20's ceilings, two H100s
    # whose rates differ by a few percent (805 against 767 TFLOP/s), so not far above it
    bf16_head = budget["profiled_steps_7b"]["ours_fp8_delayed"]
    assert 0.8 * bf16_ceiling < bf16_head["sixteen_bit_gemm_tflops"] < 1.1 * bf16_ceiling


def test_the_cast_model_is_refused_where_its_calls_are_not_the_profiles(tmp_path):
    """The model's calls per kind must be the profile's (both contenders pass in `budget`); a profile with a cast
    call more is refused."""
    profile = json.loads((RESULTS_DIR / "run21" / "profile_step.json").read_text())
    gpu = profile["llama2_7b_8layers"]["ours_fp8_delayed"]["gpu_only"]
    row = next(k for k in gpu["top_kernels"] if fp8_step_budget.CAST_KINDS["e5m2_with_transposed_copy"] in k["name"])
    row["calls_per_step"] += 1
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    with pytest.raises(ValueError, match="e5m2_with_transposed_copy calls"):
        fp8_step_budget.main(["--profile", str(tmp_path / "profile.json"), "--out", str(tmp_path / "out.json")])


def test_the_cast_model_follows_the_shape():
    shape = {"tokens": 8192, "hidden": 4096, "inter": 11008, "vocab": 32000, "layers": 8, "heads": 32, "kv_heads": 8}
    bf16, fp8 = fp8_step_budget.cast_model(shape, "bf16"), fp8_step_budget.cast_model(shape, "fp8")
    assert "lm_head" not in bf16["e4m3_with_transposed_copy"] and bf16["amax"] == {}
    assert set(fp8["amax"]) == {"lm_head"}
    # grouped-query attention: qkv's output is hidden + 2 * hidden * kv_heads / heads wide
    assert bf16["e5m2_with_transposed_copy"]["output_gradients"] == (24, 8 * 4 * 8192 * (4096 + 6144 + 4096))


def test_what_is_left_comes_out_of_the_measured_step(budget):
    head = budget["profiled_steps_7b"]["ours_fp8_delayed_fp8_head"]
    left = budget["left_to_win_ms"]
    # every cast pass but the LM head's (current-scaled per chunk in run 21) and the amax passes, each kernel's time shared
    # between its parts by bytes
    casts = sum(c["ms"] * (1 - c["bytes"].get("lm_head", 0) / sum(c["bytes"].values()))
                for kind, c in head["casts"].items() if kind != "amax")
    assert left["activation_and_gradient_casts_into_their_producers"] + left["weight_casts"] == pytest.approx(casts)
    assert casts < head["cast_ms"]
    assert left["no_idle"] == head["idle_ms"]
    rows = {(r["config"], r["recipe"]): r for r in budget["targets"]}
    profiled = rows[("llama2_7b_8layers", "ours_fp8_delayed_fp8_head")]
    estimate = budget["with_all_of_it_7b"]
    assert estimate["forward_backward_ms"] == pytest.approx(profiled["forward_backward_ms"] - sum(left.values()))
    assert estimate["ratio"] == pytest.approx(profiled["peer_forward_backward_ms"] / estimate["forward_backward_ms"])
    for row in rows.values():
        assert row["forward_backward_needed_ms"] == pytest.approx(row["peer_forward_backward_ms"] / 1.7)
    # the FP8 head's estimate from the bf16-head profile against the same run's timed difference
    head = budget["fp8_lm_head_7b"]
    assert head["measured_ms"] == pytest.approx(
        rows[("llama2_7b_8layers", "ours_fp8_delayed")]["forward_backward_ms"] - profiled["forward_backward_ms"])
    assert len(head["measured_per_round_ms"]) == 3
    assert 0 < head["estimated_ms"] < budget["profiled_steps_7b"]["ours_fp8_delayed"]["sixteen_bit_gemm_ms"]
    # every combination of the levers, the three together last
    combinations = budget["left_to_win_combinations_7b"]
    assert len(combinations) == 7
    assert combinations[-1]["forward_backward_ms"] == pytest.approx(estimate["forward_backward_ms"])


def test_a_profile_missing_gemm_kernels_is_refused(tmp_path):
    profile = json.loads((RESULTS_DIR / "run21" / "profile_step.json").read_text())
    gpu = profile["llama2_7b_8layers"]["ours_fp8_delayed"]["gpu_only"]
    gpu["top_kernels"] = [k for k in gpu["top_kernels"] if not k["name"].startswith("nvjet_sm90_qr")]
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    with pytest.raises(ValueError, match="longer kernel list"):
        fp8_step_budget.main(["--profile", str(tmp_path / "profile.json"), "--out", str(tmp_path / "out.json")])
