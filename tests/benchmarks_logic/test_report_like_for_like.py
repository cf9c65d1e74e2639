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
    assert TIE_RULE in report.render()  # stated once, above every GPU table
    ours_step = table_line(out, "| llama2_7b_8layers | ours |")
    assert "hf_liger_amp: 1.029x, faster" in ours_step  # 165.2 / 160.5, the fastest whole step
    assert "hf_liger: 1.045x, faster" in ours_step  # 151.5 / 145.0, the fastest forward+backward
    ours_opt_line = table_line(out, "| llama2_7b_8layers | ours |", "28 B")
    assert "paddle: 1.003x, tie" in ours_opt_line
    assert f"ours, hf_liger: {ours_opt.rstrip('.')}" in text and f"hf_liger_amp: {trainer_opt.rstrip('.')}" in text
    assert "error: RuntimeError('skipped')" in text


def timing(samples, **fields):
    return {**percentiles(samples), **fields}


def test_fp8_accumulation_rows_stay_in_the_json_and_loss_names_compile(tmp_path, monkeypatch):
    """REPORT's FP8 FFN table compares single calls only: the 4-call `_accumulate4` rows (faster per
    call, and a loop of their own) are neither rendered nor the best peer of a single-call row; the
    fused loss names torch.compile where it is the fastest peer."""
    shape = {"model": "llama3_8b", "tokens": 8192}
    ffn = [{**shape, "impl": "ours_fp8_current", **timing([7.0, 7.1, 7.2])},
           {**shape, "impl": "torchao_tensorwise", **timing([9.0, 9.1, 9.2])},
           {**shape, "impl": "torch_compile_bf16", **timing([13.0, 13.1, 13.2])},
           {**shape, "impl": "ours_fp8_current_accumulate4", **timing([6.0, 6.1, 6.2])},
           {**shape, "impl": "torchao_tensorwise_accumulate4", **timing([8.9, 9.0, 9.1])},
           {**shape, "impl": "torchao_rowwise_accumulate4", "error": "RuntimeError('x')"},
           {**shape, "impl": "six_fp8_gemms_alone", **timing([6.7, 6.75, 6.8])}]
    loss = [{"vocab": 128256, "impl": "hf_eager", **timing([30.0, 30.1, 30.2])},
            {"vocab": 128256, "impl": "hf_torch_compile", **timing([20.0, 20.1, 20.2])},
            {"vocab": 128256, "impl": "liger_flce", **timing([24.0, 24.1, 24.2])},
            {"vocab": 128256, "impl": "ours", **timing([22.0, 22.1, 22.2])},
            {"vocab": 128256, "impl": "reference_sizes", "logits_bf16_bytes": 1}]
    run = tmp_path / "run15"
    run.mkdir()
    (run / "fp8_ffn.json").write_text(json.dumps({"environment": ENVIRONMENT, "command": "bench_fp8_ffn", "ffn": ffn}))
    (run / "step.json").write_text(json.dumps({"environment": ENVIRONMENT, "command": "bench_step", "loss": loss}))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    out = []
    report.like_for_like_sections(out, "run15")
    assert "torchao_tensorwise: 1.282x, faster" in table_line(out, "| llama3_8b | 8192 | ours_fp8_current |")
    assert not any("_accumulate4 |" in line for line in "\n".join(out).splitlines() if line.startswith("| llama3"))
    assert "hf_torch_compile: 0.910x, slower" in table_line(out, "| 128256 | ours |")


def packed_row(step_ms, layout, first_loss):
    summary = percentiles(step_ms)
    return {**summary, "step": summary, "forward_backward": percentiles([t - 20 for t in step_ms]),
            "optimizer": percentiles([20.0] * len(step_ms)), "labelled_tokens_per_s": 10558 / (summary["p50_ms"] * 1e-3),
            "peak_bytes": 50 * 2**30, "first_losses": [first_loss], "layout": layout}


def test_packed_sft_table_reports_each_layouts_work_and_the_targets(tmp_path, monkeypatch):
    from benchmarks.common import compare

    step = {"examples": 85, "labelled_tokens": 10558, "real_tokens": 15910, "packed_shape": [4, 3993],
            "padded_batch_size": 8, "token_slots": {"packed": 15972, "flattened": 15910, "padded": 22264}}
    results = {"ours_packed": packed_row([300.0, 301.0, 302.0], "packed", 10.40),
               "hf_liger_padding_free": packed_row([340.0, 341.0, 342.0], "flattened", 10.41),
               "hf_liger_padded": {"error": "OutOfMemoryError()"}}
    comparison = {"hf_liger_padding_free": {**compare(results["ours_packed"], results["hf_liger_padding_free"]),
                                            "target": 1.15, "meets_target": False,
                                            "first_loss_relative_difference": 0.01 / 10.41}}
    run = tmp_path / "run15"
    run.mkdir()
    (run / "packed_sft.json").write_text(json.dumps({
        "environment": ENVIRONMENT, "command": "python3 -m benchmarks.gpu.bench_packed_sft", "model": {"seq": 4096},
        "packed_sft": {"gsm8k": {"step": step, "results": results, "comparison": comparison}}}))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    out = []
    report.like_for_like_sections(out, "run15")
    ours = table_line(out, "| gsm8k | ours_packed |")
    assert "15972 (0% padding)" in ours and "10.4000" in ours and "35076" in ours  # 10558 / 0.301 s
    assert "15910 (0% padding)" in table_line(out, "| gsm8k | hf_liger_padding_free |")
    assert "error: OutOfMemoryError()" in table_line(out, "| gsm8k | hf_liger_padded |")
    verdict = table_line(out, "| gsm8k | hf_liger_padding_free |", "x (")
    assert "1.133x (faster)" in verdict and "1.15x" in verdict and "not met" in verdict


def test_rope_sweep_table_compares_each_build_with_liger(tmp_path, monkeypatch):
    """bench_gpu's rope_sweep rows (the kernels table's layout, one impl per build) render as a table
    of their own, every build of ours against Liger's rope of the same widths and pass."""
    def row(model, pass_name, impl, samples, **fields):
        return {"op": "rotary", "model": model, "pass": pass_name, "impl": impl, "bytes": 1,
                **timing(samples), "fraction_of_copy": 0.9, **fields}

    sweep = [row("7B", "fwd+bwd", "ours", [0.153, 0.153, 0.153], heads_per_thread=1),
             row("7B", "fwd+bwd", "ours_heads_per_thread_4", [0.138, 0.138, 0.138], heads_per_thread=4),
             row("7B", "fwd+bwd", "liger", [0.141, 0.141, 0.141]),
             {"op": "rotary", "model": "7B", "pass": "fwd+bwd", "impl": "ours_heads_per_thread_8", "bytes": 1,
              "error": "RuntimeError('launch')"}]
    bench = {"environment": {**ENVIRONMENT, "driver": "570"}, "command": "python3 -m benchmarks.gpu.bench_gpu",
             "ceilings": {"copy_bytes_per_s": 4.09e12, "bf16_gemm_tflops": 749.0}, "rope_sweep": sweep}
    run = tmp_path / "run17"
    run.mkdir()
    (run / "gpu_bench.json").write_text(json.dumps(bench))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    out = []
    report.like_for_like_sections(out, "run17")
    assert any("Rotary sweep" in chunk for chunk in out)
    assert "liger: 0.922x, slower" in table_line(out, "| rotary | 7B | fwd+bwd | ours |")  # 0.141 / 0.153
    assert "liger: 1.022x, faster" in table_line(out, "| rotary | 7B | fwd+bwd | ours_heads_per_thread_4 |")
    assert "error: RuntimeError('launch')" in table_line(out, "| rotary | 7B | fwd+bwd | ours_heads_per_thread_8 |")
