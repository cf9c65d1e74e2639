"""benchmarks/fp8_step_budget.py against the committed measurements it reads: its GEMM split must account for
every GEMM kernel of the profiled step, its FP8 GEMM rate must lie between the card's bf16 GEMM ceiling and
FP8's twice that, and its savings must come out of parts of the measured step."""

import json

import pytest

from benchmarks import fp8_step_budget
from benchmarks.common import RESULTS_DIR


@pytest.fixture(scope="module")
def budget(tmp_path_factory):
    out = fp8_step_budget.main(["--out", str(tmp_path_factory.mktemp("budget") / "fp8_step_budget.json")])
    return json.loads(out.read_text())


def test_the_gemm_split_accounts_for_every_gemm_kernel(budget):
    step = budget["profiled_step_7b"]
    assert step["fp8_gemm_ms"] > 0 and step["sixteen_bit_gemm_ms"] > 0
    assert step["fp8_gemm_ms"] + step["sixteen_bit_gemm_ms"] == pytest.approx(step["kernel_ms_by_category"]["gemm"])
    # forward (4 per layer) and dgrad + wgrad (8 per layer) of the four projections, 8 layers
    assert step["fp8_gemm_calls"] == 12 * 8


def test_rates_lie_within_the_cards_ceilings(budget):
    step = budget["profiled_step_7b"]
    bf16_ceiling = budget["inputs"]["ceilings_used"]["bf16_gemm_tflops"]
    assert bf16_ceiling < step["fp8_gemm_tflops"] < 2 * bf16_ceiling
    # the bf16 LM head's GEMMs run near the bf16 ceiling, not above it
    assert 0.8 * bf16_ceiling < step["sixteen_bit_gemm_tflops"] < 1.02 * bf16_ceiling


def test_savings_come_out_of_the_measured_step(budget):
    step, savings = budget["profiled_step_7b"], budget["estimated_savings_ms"]
    assert savings["fp8_lm_head"] < step["sixteen_bit_gemm_ms"]
    assert savings["weight_amax_in_adamw"] < step["cast_ms"]
    assert savings["no_idle"] == step["idle_ms"]
    estimate = budget["with_every_candidate_7b"]
    assert 0 < estimate["forward_backward_ms"] < step["forward_backward_span_ms"]
    rows = {(r["config"], r["recipe"]): r for r in budget["targets"]}
    profiled = rows[("llama2_7b_8layers", "ours_fp8_delayed")]
    assert estimate["ratio"] == pytest.approx(profiled["peer_forward_backward_ms"] / estimate["forward_backward_ms"])
    for row in rows.values():
        assert row["forward_backward_needed_ms"] == pytest.approx(row["peer_forward_backward_ms"] / 1.7)


def test_a_profile_missing_gemm_kernels_is_refused(tmp_path):
    profile = json.loads((RESULTS_DIR / "run19" / "profile_step.json").read_text())
    gpu = profile["llama2_7b_8layers"]["ours_fp8_delayed"]["gpu_only"]
    gpu["top_kernels"] = [k for k in gpu["top_kernels"] if not k["name"].startswith("nvjet_sm90_qr")]
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    with pytest.raises(ValueError, match="longer kernel list"):
        fp8_step_budget.main(["--profile", str(tmp_path / "profile.json"), "--out", str(tmp_path / "out.json")])
