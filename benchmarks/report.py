"""Builds benchmarks/results/REPORT.md from the committed results files: the CPU results, the GPU runs
that README.md's results table cites, and a table of the earlier runs with the commit to read them at.

    python -m benchmarks.report

Needs neither torch nor Paddle (json only); the same files give the same REPORT.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import TIE_RULE
from benchmarks.report_tables import (convergence_section, full_depth_section, like_for_like_decoder, like_for_like_fp8,
                                      like_for_like_kernels, like_for_like_loss, like_for_like_optimizer,
                                      like_for_like_packed_sft, like_for_like_step, table)

__all__ = ["RESULTS", "main", "like_for_like_sections", "full_depth_section"]

RESULTS = Path(__file__).resolve().parent / "results"

# The GPU runs whose files README.md's results table cites, newest first, and the files of each that
# REPORT.md renders (None: every file of the run folder). Run 15's kernel, decoder and packed-SFT
# tables are superseded by run 17's or cited by no row; its files stay in the folder for step_floor.py.
# Run 17's LLaMA-2-7B LoRA rows are superseded by run 18's (same workload, current code); run 19 re-times the GSM8K
# LoRA row and the 80 GB full fine-tune on later code beside run 18's oasst1-zh rows; run 20 re-times the LoRA rows
# (both profiles, and Llama-3-8B), the whole step and the FP8 FFN on the code of its commit; run 21 re-times the whole
# step and the loss table (with the FP8 LM head) and trains the FP8 head on the convergence harness; run 22 re-times
# the 7B-width step on main with the host-overhead and frozen-head-chunks branches merged (its LoRA file is one cut
# round, not rendered); run 23 re-times the 7B GSM8K LoRA row on the code with the one-node LoRA projection (its
# files from the code before it, c1 and c5's 9e2d895, and from 2d46436, c3, are in its README, not rendered); run 25
# times the full-depth full fine-tune under gradient accumulation on an H100 (the low-memory optimizer state).
CURRENT_GPU_RUNS = (("run25", ("full_depth.json",)), ("run24", ("step.json",)),
                    ("run23", ("full_depth_lora_gsm8k_c4_e1180fb.json", "full_depth_lora_gsm8k_2rows_c4_e1180fb.json",
                               "full_depth_lora_gsm8k_c5_e1180fb.json")),
                    ("run22", ("step.json",)), ("run21", None),
                    ("run20", ("convergence.json", "convergence_distances.json", "fp8_ffn.json",
                               "full_depth_lora_gsm8k.json", "full_depth_lora_oasst1_zh.json",
                               "full_depth_lora_llama3_8b_gsm8k.json")),
                    ("run19", None), ("run18", None),
                    ("run17", ("gpu_bench.json", "packed_sft.json", "full_depth_llama3_8b.json")),
                    ("run16", None), ("run15", ("step.json", "optimizer.json", "fp8_ffn.json")))

# The last commit whose tree holds every results file of the runs below (removed from the tree since;
# `git show ARCHIVE_COMMIT:benchmarks/results/<run>/<file>` prints one, `git ls-tree` lists them).
ARCHIVE_COMMIT = "8c5140e"

# (folder or files, date, device, commits its README names, what it measured)
EARLIER_RUNS = (
    ("run14/", "2026-12-04", "H200", "384e920, 1c9bd44",
     "FP8 tile kernels loading one segment ahead; whole step, decoder layer, FP8 FFN; RMSNorm at full occupancy "
     "(rejected)"),
    ("run13/", "2026-12-04", "H200", "4942609, 6bbf8c4",
     "FP8 FFN saving gate_up's FP8 copy for backward; FP8 convergence with it; decoder layer; whole step"),
    ("run12/", "2026-12-03", "H200", "c67ffb5, 417e0aa, 54e4aa7, 077f9ef, b42b9a5, bac41d8, 6e4d7b9, 95b63f8",
     "fused loss with one synchronisation per pass; AdamW grid sweep; flat amax pass; whole-step kernel timeline "
     "(`profile_step.json` stays in the tree: step_floor.py reads it)"),
    ("run11/", "2026-12-03", "H200", "bd56177, 703e10c, c404b1a, 641c7f7",
     "persistent plain RMSNorm forward; fused loss without its zero fill; FP8 convergence with the delayed-scaling "
     "warm start; register-resident RMSNorm backward (rejected)"),
    ("run10/", "2026-12-03", "H200", "6f07495",
     "whole step with FastAdamW's kernel; FP8 decoder layer and FFN on the Paddle path's FP8 composition; "
     "optimizer alone"),
    ("run9/", "2026-12-02", "H200", "086e7b0, 5a5633f, 58b8042, d4e7e34, 6afa826",
     "FP8 quantisation kernels at bandwidth; whole step with its optimizer share; projection GEMMs; norms"),
    ("run8/", "2026-12-02", "H200", "3a96b43, 41c8ce0, cf5f9ce, 67d9d8f",
     "whole step; FP8 decoder layer; FP8 FFN grid at 2k-16k tokens; first FP8 convergence"),
    ("gpu_h200*.json, gpu_*.png, gpu_tests_*.log, history/", "2026-12-02", "H200",
     "1836cd9, adcd57c (history/README.md names each)",
     "runs 1-7 before run folders: kernels and decoder layer (run 7), bf16 FFN (run 4), RMSNorm sweeps (runs 3, 5, "
     "6), first FP8 FFN (run 7); sequential timing (runs 1-2); plots of runs 8-14"),
    ("cpu_lengths_1thread.json, cpu_lengths_after_2t.json, cpu_lengths_before_libgomp.json, "
     "cpu_parallel_threshold.json", "2026-12-05", "2-core AMD EPYC", "-",
     "CPU real-length fine-tune at one thread and before/after the libgomp and two-thread changes; the CPU "
     "kernels' parallel threshold sweep"),
)


GPU_PREAMBLE = ("GPU tables, like for like: peers as their users set them up, our kernels through the torch binding "
                "(PyTorch's cuBLAS and SDPA standing in for Paddle's). Each row: the median over round-robin repeats "
                f"and, in parentheses, their spread; `vs best peer` names the fastest peer of that table by "
                f"measurement. {TIE_RULE}\n")


def _load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def cpu_sections(out):
    ops = _load("cpu_ops.json")
    if ops:
        out.append(f"## CPU operators ({ops['device']['cpu']}, {ops['device']['cores']} cores, float32)\n")
        out.append(f"`{ops['command']}` on {ops['date']}; Paddle {ops['versions']['paddle']}, "
                   f"PaddleNLP {ops['versions']['paddlenlp']}. Forward+backward, median of "
                   f"{ops['results'][0]['fastffn_ms']['repeats']} repeats, both sides in the same run.\n")
        out.append(table(["op", "shape", "baseline", "baseline ms", "paddle_fastffn ms", "speedup"],
                         [[r["op"], r["shape"], r["baseline"], f"{r['baseline_ms']['p50_ms']:.1f}",
                           f"{r['fastffn_ms']['p50_ms']:.1f}", f"{r['speedup_p50']:.2f}x"] for r in ops["results"]]))
        out.append("")
    ft = _load("cpu_finetune_demo.json")
    if ft:
        out.append(f"## CPU fine-tune, embedded demo model ({ft['steps']} steps, {ft['device']['cpu']})\n")
        out.append(f"`{ft['command']}` on {ft['date']}. {ft['what']}.\n")
        rows = []
        for key, label in (("step_time_ms", "step time (ms)"), ("tokens_per_second", "tokens/s"),
                           ("peak_memory_mb", "peak RSS (MiB)"), ("eval_loss", "eval loss")):
            rows.append([label, f"{ft['stock'][key]:.2f}", f"{ft['fast'][key]:.2f}",
                         f"{ft['fast'][key] / ft['stock'][key]:.3f}"])
        out.append(table(["", "stock", "use_fast_ffn", "fast / stock"], rows))
        out.append("")


def cpu_lengths_section(out):
    lengths = _load("cpu_lengths.json")
    if not lengths:
        return
    out.append(f"## CPU fine-tune on real SFT lengths ({lengths['device']['cpu']}, {lengths['device']['cores']} cores)\n")
    load = lengths["load_average"]
    out.append(f"`{lengths['command']}` on {lengths['date']}. {lengths['what']}. Median of "
               f"{lengths['repeats']} repeats, contenders alternated within each repeat; spread = "
               f"(max - min) / median; load average {load['start'][0]:.1f} at start, {load['end'][0]:.1f} "
               f"at end (shared machine).\n")
    rows = []
    for result in lengths["results"]:
        stock = result["rows"]["stock_padded"]
        for name, row in result["rows"].items():
            rows.append([result["profile"], result["threads"], name, result["examples"],
                         f"{row['seconds_median']:.1f}", f"{row['spread']:.0%}",
                         f"{row['effective_tokens_per_second']:.0f}",
                         f"{stock['seconds_median'] / row['seconds_median']:.2f}x",
                         f"{stock['cpu_seconds_median'] / row['cpu_seconds_median']:.2f}x"])
    out.append(table(["profile", "threads", "contender", "examples", "median s", "spread",
                      "labelled tokens/s", "vs stock padded (wall)", "vs stock padded (CPU time)"], rows))
    out.append("")


def like_for_like_sections(out, run, files=None):
    """The tables of one run folder from any of gpu_bench.json, step.json, optimizer.json,
    fp8_ffn.json, packed_sft.json, full_depth.json, full_depth_<model>.json and convergence.json with
    its convergence_distances.json; `files` limits them to those names."""
    def load(name):
        return _load(f"{run}/{name}") if files is None or name in files else None

    per_model = [load(p.name) for p in sorted((RESULTS / run).glob("full_depth_*.json"))]  # one file per model
    bench, step, optimizer, fp8 = load("gpu_bench.json"), load("step.json"), load("optimizer.json"), load("fp8_ffn.json")
    packed_sft, full_depth = load("packed_sft.json"), load("full_depth.json")
    per_model = [r for r in per_model if r and "workloads" in r]
    distances, convergence = load("convergence_distances.json"), load("convergence.json")
    if not (bench or step or optimizer or fp8 or packed_sft or full_depth or per_model or distances):
        return
    out.append(f"## GPU {run} ({run}/README.md: its calls, commits and commands)\n")
    if bench and "kernels" in bench:
        like_for_like_kernels(out, bench)
    if bench and "rope_sweep" in bench:
        like_for_like_kernels(
            out, bench, "rope_sweep", "Rotary sweep: ours per FASTFFN_ROTARY_HEADS_PER_THREAD build against Liger's",
            "`ours` is the default build (1 head per thread), `ours_heads_per_thread_N` the build with N; every "
            "build and Liger's rope in one round-robin table, layouts and bytes as in the kernels table.")
    if bench and "decoder_layer" in bench:
        like_for_like_decoder(out, bench)
    if step and "step" in step:
        like_for_like_step(out, step)
    if step and "loss" in step:
        like_for_like_loss(out, step)
    if optimizer:
        like_for_like_optimizer(out, optimizer)
    if fp8 and "ffn" in fp8:
        like_for_like_fp8(out, fp8)
    if packed_sft and "packed_sft" in packed_sft:
        like_for_like_packed_sft(out, packed_sft)
    if full_depth and "workloads" in full_depth:
        full_depth_section(out, full_depth)
    for i, run_of_model in enumerate(per_model):  # the method paragraph once per run
        full_depth_section(out, run_of_model, conventions=i == 0 and not full_depth)
    if distances and convergence:
        convergence_section(out, distances, convergence)


def earlier_runs_section(out):
    out.append("## Earlier runs\n")
    out.append(f"Removed from the tree; commit {ARCHIVE_COMMIT} holds them all: `git show {ARCHIVE_COMMIT}:benchmarks/"
               f"results/run12/README.md` prints a run's README (its files, commits and commands), `git ls-tree -r "
               f"{ARCHIVE_COMMIT} benchmarks/results/` lists every file, and `git show {ARCHIVE_COMMIT}:benchmarks/"
               f"results/REPORT.md` is the report of them all. They predate the like-for-like method above.\n")
    out.append(table(["files (benchmarks/results/)", "date", "device", "commits", "what it measured"],
                     [list(row) for row in EARLIER_RUNS]))
    out.append("")


def render() -> str:
    out = ["# paddle_fastffn benchmark report", "",
           "Generated by `python -m benchmarks.report` from the results files in this folder; each records its "
           "command, date, device and versions. The current results: the CPU runs and the GPU runs that "
           "README.md's results table cites. Earlier runs: the last section.", ""]
    cpu_sections(out)
    cpu_lengths_section(out)
    out.append(GPU_PREAMBLE)
    for run, files in CURRENT_GPU_RUNS:
        like_for_like_sections(out, run, files)
    earlier_runs_section(out)
    return "\n".join(out) + "\n"


def main():
    path = RESULTS / "REPORT.md"
    path.write_text(render())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
