"""benchmarks/report.py's like-for-like tables name the best peer of each table by measurement and
apply the tie rule (benchmarks/common.py), from results in the layout bench_step.py and
bench_optimizer.py write (round-robin summaries: median, spread, repeats)."""

import json

from benchmarks import report
from benchmarks.common import TIE_RULE, percentiles

ENVIRONMENT = {"date": "2026-12-06T00:00:00+00:00", "device": "NVIDIA H200", "torch": "2.11",
               "liger_kernel": "0.8.5", "transformers": "4.57"}


def table_line(out, prefix, containing=""):
    """The first rendered table line starting with `prefix` that contains `containing`."""
    return next(line for chunk in out for line in chunk.splitlines() if line.startswith(prefix) and containing in line)


def step_row(step, forward_backward, optimizer, used):
    summary = percentiles(step)
    return {**summary, "step": summary, "forward_backward": percentiles(forward_backward),
            "optimizer": percentiles(optimizer), "tokens_per_s": 8192 / (summary["p50_ms"] * 1e-3),
            "peak_bytes": 40 * 2**30, "optimizer_used": used}


def test_step_table_names_the_fastest_peer_per_part_and_calls_ties(tmp_path, monkeypatch):
    ours_opt, trainer_opt = "One-pass master-weight AdamW.", "torch fused AdamW on fp32 parameters."
    step = {"environment": ENVIRONMENT, "command": "python3 -m benchmarks.gpu.bench_step", "step": {
        "llama2_7b_8layers": {
            "ours": step_row([160.0, 160.5, 161.0], [144.5, 145.0, 145.5], [15.5, 15.5, 15.5], ours_opt),
            "hf_liger": step_row([166.0, 166.5, 167.0], [151.0, 151.5, 152.0], [15.5, 15.5, 15.5], ours_opt),
            # faster whole step than hf_liger but slower forward+backward: each column picks its own peer
            "hf_liger_amp": step_row([165.0, 165.2, 165.4], [152.0, 152.2, 152.4], [13.0, 13.0, 13.0], trainer_opt),
            "hf_torch_compile": {"error": "RuntimeError('skipped')"},
            "shape": {"vocab": 32000}}}}
    optimizer = {"environment": ENVIRONMENT, "command": "python3 -m benchmarks.gpu.bench_optimizer",
                 "llama2_7b_8layers": {
                     name: {"parameters": 1.9e9, "bytes_per_parameter": 28, "graph": {**percentiles(t),
                            "fraction_of_copy": 0.9}, "eager": percentiles([x + 1 for x in t]), **percentiles(t)}
                     for name, t in (("ours", [10.0, 10.05, 10.1]), ("paddle", [10.06, 10.08, 10.1]),
                                     ("three_pass", [14.0, 14.1, 14.2]))}}
    run = tmp_path / "run15"
    run.mkdir()
    (run / "step.json").write_text(json.dumps(step))
    (run / "optimizer.json").write_text(json.dumps(optimizer))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    out = []
    report.like_for_like_sections(out, "run15")
    text = "\n".join(out)
    assert TIE_RULE in text
    ours_step = table_line(out, "| llama2_7b_8layers | ours |")
    assert "hf_liger_amp: 1.029x, faster" in ours_step  # 165.2 / 160.5, the fastest whole step
    assert "hf_liger: 1.045x, faster" in ours_step  # 151.5 / 145.0, the fastest forward+backward
    ours_opt_line = table_line(out, "| llama2_7b_8layers | ours |", "28 B")
    assert "paddle: 1.003x, tie" in ours_opt_line
    assert f"ours, hf_liger: {ours_opt.rstrip('.')}" in text and f"hf_liger_amp: {trainer_opt.rstrip('.')}" in text
    assert "error: RuntimeError('skipped')" in text
