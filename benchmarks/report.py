"""Builds benchmarks/results/REPORT.md and the PNG plots from the committed results JSON.

    python -m benchmarks.report
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import SPIKE_RATIO, TIE_RULE, against_best_peer, same_batch_spikes, spread_ms, timed

RESULTS = Path(__file__).resolve().parent / "results"
RUN8 = "run8"  # the H200 run of 2026-12-02 (three device calls; run8/README.md says which file is which)
RUN9 = "run9"  # the H200 run of the next session, same day (run9/README.md says which file is which)
RUN10 = "run10"  # the H200 run of 2026-12-03, one device call (run10/README.md)
RUN11 = "run11"  # the next session's H200 run, same day (run11/README.md)
RUN12 = "run12"  # the H200 calls of the session after, same day (run12/README.md)
RUN13 = "run13"  # the H200 calls of 2026-12-04 (run13/README.md)
RUN14 = "run14"  # the H200 calls of the next session, same day (run14/README.md)
# The like-for-like re-measurement (issue 20 item 6, run by issue 23): every table round-robin with
# median, spread and the best peer by measurement; bench_*.py --out files copied into this folder.
RUN15 = "run15"
# The next session's H200 calls (issue 23 item 4's full-depth 7B, then the shared layer's GPU tests and
# re-measurement): run16/README.md maps each call to its commit and command.
RUN16 = "run16"
# The first run on an H100 80 GB: the user's job at full depth on packed real lengths (run17/README.md).
RUN17 = "run17"


def _load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _run_loader(run):
    """_load for the files of one run folder (run8/, run9/)."""
    return lambda name: _load(f"{run}/{name}")


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is missing (no plots)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_sections(out):
    ops = _load("cpu_ops.json")
    if ops:
        out.append(f"## CPU operators ({ops['device']['cpu']}, {ops['device']['cores']} cores, float32)\n")
        out.append(f"`{ops['command']}` on {ops['date']}; Paddle {ops['versions']['paddle']}, "
                   f"PaddleNLP {ops['versions']['paddlenlp']}. Forward+backward, median of "
                   f"{ops['results'][0]['fastffn_ms']['repeats']} repeats, both sides in the same run.\n")
        out.append(_table(["op", "shape", "baseline", "baseline ms", "paddle_fastffn ms", "speedup"],
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
        out.append(_table(["", "stock", "use_fast_ffn", "fast / stock"], rows))
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
    out.append(_table(["profile", "threads", "contender", "examples", "median s", "spread",
                       "labelled tokens/s", "vs stock padded (wall)", "vs stock padded (CPU time)"], rows))
    out.append("")


def run_header(out, title, run):
    """A section's title and the run it comes from: command, date, device, versions, ceilings."""
    env, ceil = run["environment"], run["ceilings"]
    versions = ", ".join(f"{name} {env[key]}" for key, name in (
        ("torch", "torch"), ("liger_kernel", "Liger-Kernel"), ("transformers", "transformers"),
        ("torchao", "torchao")) if env.get(key))
    out.append(f"### {title}\n")
    out.append(f"`{run['command']}` on {env['date']}, {env['device']} (driver {env['driver']}, {versions}, "
               f"{env['nvcc']}). {run.get('note', '').rstrip('.') + '.' if run.get('note') else ''} Ceilings measured in the same run: device copy "
               f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), bf16 GEMM 8192^3 "
               f"{ceil['bf16_gemm_tflops']:.0f} TFLOP/s.\n")


def gpu_sections(out, kernels_run, ffn_run, plots):
    out.append("## GPU (NVIDIA H200, standalone harness: our kernels through ctypes, torch's cuBLAS and SDPA "
               "standing in for Paddle's GEMMs and flash attention; FP8 GEMMs through our cuBLASLt provider)\n")
    gpu = kernels_run
    run_header(out, "Kernels (bf16, 8192 tokens; CUDA-graph replay, median)", gpu)
    out.append("Fraction = bytes (each input read once, each output written once) / time / copy bandwidth. "
               "A read-heavy kernel can exceed a 50/50 copy's rate.\n")
    rows = []
    for r in gpu["kernels"]:
        if "error" in r:
            rows.append([r["op"], r["model"], r["pass"], r["impl"], "error", "", ""])
            continue
        rows.append([r["op"], r["model"], r["pass"], r["impl"], f"{r['p50_ms'] * 1e3:.0f}",
                     f"{r['GB_per_s']:.0f}", f"{r['fraction_of_copy'] * 100:.0f}%"])
    out.append(_table(["op", "widths", "pass", "impl", "µs", "GB/s", "of copy"], rows))
    out.append("")
    gpu = ffn_run
    run_header(out, "FFN forward+backward (bf16; interleaved timing, median)", gpu)
    out.append("`ours` = gate_up GEMM + our SwiGLU (recompute in backward, gradient in place) + down GEMM. "
               "`gemms alone` = the same GEMM calls without our kernel: the floor of this design. "
               "Saved activations = memory held between forward and backward; peak = max allocated during "
               "forward+backward above the start (includes weight-gradient reallocation).\n")
    by = {}
    for r in gpu["ffn"]:
        if "p50_ms" in r:
            by.setdefault((r["model"], r["tokens"]), {})[r["impl"]] = r
    rows = []
    for (model, tokens), d in by.items():
        ours = d.get("ours_fused_gemm_recompute") or d["ours_recompute"]
        eager, liger, gemms = d["eager_unfused"], d.get("liger_swiglu"), d["gemms_alone_fused_layout"]
        best = min(eager["p50_ms"], liger["p50_ms"]) if liger else eager["p50_ms"]
        compiled = d.get("torch_compile_unfused")
        rows.append([model, tokens, f"{ours['p50_ms']:.2f}", f"{eager['p50_ms']:.2f}", f"{d['eager_fused_gate_up']['p50_ms']:.2f}",
                     f"{liger['p50_ms']:.2f}" if liger else "", f"{compiled['p50_ms']:.2f}" if compiled else "",
                     f"{gemms['p50_ms']:.2f}", f"{ours['p50_ms'] / best:.3f}", f"{(1 - gemms['p50_ms'] / ours['p50_ms']) * 100:.1f}%",
                     f"{ours['saved_activation_bytes'] / eager['saved_activation_bytes']:.2f}",
                     f"{ours['peak_bytes'] / eager['peak_bytes']:.2f}"])
    out.append(_table(["model", "tokens", "ours ms", "eager unfused", "eager fused gate_up", "Liger", "torch.compile",
                       "gemms alone", "ours / best peer", "outside GEMMs", "saved act. vs eager", "peak vs eager"], rows))
    out.append("")
    gpu = kernels_run
    dec = gpu.get("decoder_layer")
    if dec:
        shape = dec["shape"]
        run_header(out, f"Decoder layer forward+backward (7B shape, batch {shape['batch']} x {shape['seq']}, bf16)", gpu)
        out.append(f"Model FLOPs: {shape['flops_convention']}. Kernel time by category from torch.profiler. "
                   "Ours executes the Paddle patch's composition step by step "
                   "(paddle_fastffn/integration/composition.py; a CPU test traces the patch against it).\n")
        rows = []
        for name in ("hf_eager", "hf_liger", "ours"):
            r = dec.get(name)
            if not r or "p50_ms" not in r:
                continue
            k = r["kernel_ms"]
            outside = (k["fastffn"] + k["other"]) / r["p50_ms"] * 100
            rows.append([name, f"{r['p50_ms']:.2f}", f"{r['model_tflops']:.0f}", f"{r['peak_bytes'] / 2**30:.2f}",
                         f"{k['gemm']:.2f}", f"{k['attention']:.2f}", f"{k['fastffn']:.2f}", f"{k['other']:.2f}", f"{outside:.1f}%"])
        out.append(_table(["layer", "ms", "model TFLOP/s", "peak GiB", "GEMM ms", "attention ms", "our kernels ms",
                           "other ms", "outside GEMM+attention"], rows))
        out.append("")
    sweep = _load("gpu_h200_rms_norm_sweep.json")
    if sweep:
        out.append("### RMSNorm forward tuning sweep (same kernel built per setting; Liger in the same run)\n")
        out.append(f"`{sweep['command']}` on {sweep['environment']['date']}; the committed default is 2 vectors "
                   "per thread. A weight-prefetch variant measured in this run was slower at every shape "
                   "and was removed.\n")
        rows = []
        for r in sweep["rms_norm_sweep"]:
            if "prefetch_weight" in r and r["prefetch_weight"]:
                continue
            setting = r.get("impl") or f"{r['vecs_per_thread']} vectors/thread"
            rows.append([r["op"], r["model"], setting, f"{r['p50_ms'] * 1e3:.1f}", f"{r['fraction_of_copy'] * 100:.0f}%"])
        out.append(_table(["op", "widths", "setting", "µs", "of copy"], rows))
        out.append("")
    for plot in plots:
        out.append(f"![{plot.stem}]({plot.name})\n")


def fp8_section(out, run):
    run_header(out, "FP8 FFN forward+backward (8192 tokens; interleaved timing, median)", run)
    out.append("FP8 = e4m3 activations and weights, e5m2 gradients, per-tensor scales, weights re-quantised "
               "every step. `six FP8 GEMMs alone` = our composition's GEMMs on pre-quantised operands: the floor. "
               "TFLOP/s are bf16-equivalent model FLOPs (6 GEMMs).\n")
    by = {}
    for r in run["ffn"]:
        if "p50_ms" in r:
            by.setdefault((r["model"], r["tokens"]), {})[r["impl"]] = r
    rows = []
    for (model, tokens), d in by.items():
        bf16, floor, tao = d["ours_bf16"]["p50_ms"], d["six_fp8_gemms_alone"]["p50_ms"], d.get("torchao_tensorwise")
        eager_saved = d["eager_bf16"]["saved_activation_bytes"]
        for impl in ("ours_fp8_current", "ours_fp8_delayed"):
            r = d[impl]
            rows.append([model, tokens, impl, f"{r['p50_ms']:.2f}", f"{r['tflops']:.0f}", f"{bf16 / r['p50_ms']:.2f}x",
                         f"{tao['p50_ms'] / r['p50_ms']:.2f}x" if tao else "", f"{(1 - floor / r['p50_ms']) * 100:.0f}%",
                         f"{r['saved_activation_bytes'] / eager_saved:.2f}"])
        for impl in ("ours_bf16", "torchao_tensorwise", "torchao_rowwise", "torch_compile_bf16", "eager_bf16",
                     "six_fp8_gemms_alone"):
            r = d.get(impl)
            if r:
                saved = r["saved_activation_bytes"]
                rows.append([model, tokens, impl, f"{r['p50_ms']:.2f}", f"{r['tflops']:.0f}", f"{bf16 / r['p50_ms']:.2f}x",
                             "", "", f"{saved / eager_saved:.2f}" if saved else ""])
    out.append(_table(["model", "tokens", "impl", "ms", "TFLOP/s", "vs ours bf16", "vs torchao tensorwise",
                       "outside FP8 GEMMs", "saved act. vs eager"], rows))
    out.append("")


def _by_shape(rows, key=("model", "tokens")):
    by = {}
    for r in rows:
        if "p50_ms" in r:
            by.setdefault(tuple(r[k] for k in key), {})[r["impl"]] = r
    return by


def quantization_section(out, run):
    run_header(out, "FP8 quantisation kernels alone (8192 tokens; CUDA-graph replay, median)", run)
    out.append("Bytes = each input read once, each output written once (an amax-only pass reads its input). "
               "`_current_scaling` = the amax pass + the device scale update + the quantising pass: what current "
               "scaling pays per tensor. Target: 85% of copy.\n")
    rows = [[r["model"], r["kernel"], f"{r['p50_ms'] * 1e3:.1f}", f"{r['bytes'] / 2**20:.0f}",
             f"{r['fraction_of_copy'] * 100:.0f}%"] for r in run["quantization_kernels"]]
    out.append(_table(["widths", "kernel", "µs", "MiB moved", "of copy"], rows))
    out.append("")


def prefetch_sweep_section(out, run):
    """The quantisation kernels of the default build against FASTFFN_FP8_PREFETCH=0 (the tile
    kernels' earlier load order), two passes each in the order default, 0, default, 0."""
    run_header(out, "FP8 quantisation kernels: loads issued ahead of the stores (default) or not "
                    "(FASTFFN_FP8_PREFETCH=0), same run", run)
    out.append("Each build measured twice, alternating (µs, median of each pass); `of copy` from the faster pass. "
               "Target: 85% of copy.\n")
    cells = {}
    for r in run["prefetch_sweep"]:
        key = (r["model"], r["kernel"])
        cells.setdefault(key, {}).setdefault(" ".join(r["defines"]) or "default", []).append(r)
    rows = []
    for (model, kernel), by in cells.items():
        new, old = by.get("default", []), by.get("FASTFFN_FP8_PREFETCH=0", [])
        if not (new and old):
            continue
        best_new = min(new, key=lambda r: r["p50_ms"])
        best_old = min(old, key=lambda r: r["p50_ms"])
        rows.append([model, kernel, " / ".join(f"{r['p50_ms'] * 1e3:.1f}" for r in old),
                     " / ".join(f"{r['p50_ms'] * 1e3:.1f}" for r in new),
                     f"{best_old['fraction_of_copy'] * 100:.0f}% -> {best_new['fraction_of_copy'] * 100:.0f}%",
                     f"{best_old['p50_ms'] / best_new['p50_ms']:.3f}x"])
    out.append(_table(["widths", "kernel", "PREFETCH=0 µs", "default µs", "of copy", "speed-up"], rows))
    out.append("")


def fp8_grid_section(out, runs):
    """FFN fwd+bwd rows from several runs; each shape's contenders come from one run."""
    out.append("### FP8 FFN forward+backward, every width and token count (interleaved timing, median)\n")
    out.append("FP8 = e4m3 activations and weights, e5m2 gradients, per-tensor scales, weights re-quantised "
               "every step (weights current-scaled under both recipes). `six FP8 GEMMs alone` = our "
               "composition's GEMMs on pre-quantised operands: the floor. TFLOP/s are bf16-equivalent model FLOPs. "
               "Each row's contenders ran in the same run, interleaved; the runs:\n")
    table = {}
    for label, run, keep in runs:
        env = run["environment"]
        out.append(f"- {label}: `{run['command']}` on {env['date']}, torch {env['torch']}, torchao {env.get('torchao')}")
        for shape, d in _by_shape(run["ffn"]).items():
            if keep(shape):
                table[shape] = d
    out.append("")
    rows = []
    order = {"llama2_7b": 0, "llama2_13b": 1, "llama2_70b": 2, "llama3_8b": 3}
    for (model, tokens), d in sorted(table.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        bf16, floor, tao = d["ours_bf16"], d["six_fp8_gemms_alone"]["p50_ms"], d["torchao_tensorwise"]["p50_ms"]
        eager_saved = d["eager_bf16"]["saved_activation_bytes"]
        cur, dl = d["ours_fp8_current"], d["ours_fp8_delayed"]
        accumulating = [d.get(f"ours_fp8_{kind}_accumulate4") for kind in ("current", "delayed")]
        rows.append([model, tokens, f"{bf16['p50_ms']:.2f}", f"{cur['p50_ms']:.2f}", f"{dl['p50_ms']:.2f}",
                     f"{tao:.2f}", f"{d['torchao_rowwise']['p50_ms']:.2f}", f"{floor:.2f}",
                     f"{bf16['p50_ms'] / cur['p50_ms']:.2f}x", f"{bf16['p50_ms'] / dl['p50_ms']:.2f}x",
                     f"{tao / cur['p50_ms']:.2f}x", f"{tao / dl['p50_ms']:.2f}x",
                     f"{(1 - floor / cur['p50_ms']) * 100:.0f}% / {(1 - floor / dl['p50_ms']) * 100:.0f}%",
                     f"{cur['saved_activation_bytes'] / eager_saved:.2f}",
                     " / ".join(f"{bf16['p50_ms'] / r['p50_ms']:.2f}x" if r else "-" for r in accumulating),
                     " / ".join(f"{tao / r['p50_ms']:.2f}x" if r else "-" for r in accumulating),
                     " / ".join(f"{(1 - floor / r['p50_ms']) * 100:.0f}%" if r else "-" for r in accumulating)])
    out.append(_table(["model", "tokens", "ours bf16 ms", "FP8 current ms", "FP8 delayed ms", "torchao tensorwise",
                       "torchao rowwise", "6 FP8 GEMMs", "current vs bf16", "delayed vs bf16",
                       "current vs torchao tw", "delayed vs torchao tw", "outside GEMMs (cur / del)",
                       "saved act. vs eager bf16",
                       "4 micro-batches per weight cast: current / delayed vs bf16", "same, vs torchao tw",
                       "same, outside GEMMs"], rows))
    out.append("")


def decoder8_section(out, run):
    run_header(out, "Decoder layer forward+backward, bf16 and FP8 linears", run)
    out.append("Model FLOPs: 3x forward, causal attention at half (FP8 rows: the same bf16-equivalent FLOPs). "
               "Ours executes the Paddle patch's composition (paddle_fastffn/integration/composition.py); with FP8, "
               "qkv and o through fp8_linear and the FFN through fp8_ffn, weights re-quantised every iteration. "
               "Kernel time by category from torch.profiler; outside = (our kernels + other) / all kernel time.\n")
    rows = []
    for config, results in run["decoder_layer"].items():
        shape = results["shape"]
        for name in ("hf_eager", "hf_torch_compile", "hf_liger", "ours", "ours_fp8_current", "ours_fp8_delayed"):
            r = results.get(name, {})
            if "p50_ms" not in r:
                rows.append([config, name, "error: " + r.get("error", "missing")[:80]] + [""] * 9)
                continue
            k = r["kernel_ms"]
            total = k["gemm"] + k["attention"] + k["fastffn"] + k["other"]
            rows.append([f"{config} ({shape['batch']}x{shape['seq']})", name, f"{r['p50_ms']:.2f}",
                         f"{r['model_tflops']:.0f}", f"{r['peak_bytes'] / 2**30:.2f}", f"{k['gemm']:.2f}",
                         f"{k['attention']:.2f}", f"{k['fastffn']:.2f}", f"{k['other']:.2f}",
                         f"{(k['fastffn'] + k['other']) / total * 100:.1f}%",
                         _versus(results, name, ("hf_eager", "hf_torch_compile", "hf_liger")) if _is_ours(name) else ""])
    out.append(_table(["layer", "impl", "ms", "model TFLOP/s", "peak GiB", "GEMM ms", "attention ms",
                       "our kernels ms", "other ms", "outside GEMM+attention", "vs best peer"], rows))
    out.append("")
    out.append(f"{TIE_RULE} Spread here: p80 - p20 of the repeats (contenders timed one after another "
               "before run 15).\n")


def loss_section(out, run):
    env = run["environment"]
    out.append("### LM head + cross-entropy forward+backward (8192 tokens x hidden 4096, bf16)\n")
    out.append(f"`{run['command']}` on {env['date']}, {env['device']}. Interleaved timing, median. Peak = "
               "memory allocated above the inputs and one set of their gradients (the previous iteration's, "
               "freed at the start). `ours` = harness.linear_cross_entropy, the Paddle op's chunked composition "
               "(1 GiB of fp32-equivalent logits per chunk, d_weight summed over chunks in fp32).\n")
    rows = []
    by_vocab = _rows_by([r for r in run["loss"] if "p50_ms" in r], ("vocab",))
    for r in run["loss"]:
        if "p50_ms" in r:
            same_vocab = by_vocab[(r["vocab"],)]
            versus = _versus(same_vocab, r["impl"], [n for n in same_vocab if not _is_ours(n)]) if _is_ours(r["impl"]) else ""
            rows.append([r["vocab"], r["impl"], f"{r['p50_ms']:.2f}", f"{r['peak_bytes'] / 2**30:.2f}", f"{r['loss']:.5f}",
                         versus])
        elif "logits_bf16_bytes" in r:
            rows.append([r["vocab"], "(sizes: bf16 / fp32 logits)",
                         "", f"{r['logits_bf16_bytes'] / 2**30:.2f} / {r['logits_fp32_bytes'] / 2**30:.2f}", "", ""])
    out.append(_table(["vocab", "impl", "ms", "peak GiB", "loss", "vs best peer (tie rule below)"], rows))
    out.append("")
    out.append(f"{TIE_RULE} Spread here: p80 - p20 of the interleaved repeats.\n")


def _optimizer_legend(step_results, key) -> str:
    """'contenders: optimizer description; ...' from each step row's `key` field (a text)."""
    optimizers = {}
    for results in step_results.values():
        for name, r in results.items():
            if isinstance(r, dict) and timed(r) and isinstance(r.get(key), str):
                optimizers.setdefault(r[key], []).append(name)
    return "; ".join(f"{', '.join(dict.fromkeys(names))}: {text.rstrip('.')}" for text, names in optimizers.items())


def step_section(out, run, first_run=None):
    env = run["environment"]
    out.append("### Whole training step: embedding, 8 decoder layers, norm, LM head + loss, AdamW on fp32 masters\n")
    out.append(f"`{run['command']}` on {env['date']}, {env['device']}, torch {env['torch']}, Liger-Kernel "
               f"{env['liger_kernel']}, transformers {env['transformers']}. 8192 tokens per step; median of 10 "
               "steps after 3 warm-up steps; contenders one after another (each holds a model and its optimizer "
               "state), `ours` measured again last to show the drift. Peak = max allocated during one step "
               "(parameters, fp32 masters, grads and AdamW state included: the same for every contender). "
               "Hugging Face models: LlamaForCausalLM with sdpa; Liger = apply_liger_kernel_to_llama (rope, "
               "RMSNorm, SwiGLU, fused linear cross-entropy); torch.compile = the whole model, default mode.\n")
    rows = []
    for config, results in run["step"].items():
        shape = results["shape"]
        liger, compiled = results.get("hf_liger", {}), results.get("hf_torch_compile", {})
        for name in ("hf_eager", "hf_torch_compile", "hf_liger", "hf_liger_amp", "ours", "ours_again",
                     "ours_fp8_current", "ours_fp8_delayed"):
            r = results.get(name)
            if r is None and name == "hf_liger_amp":
                continue  # runs before run 10 had no such contender
            r = r or {}
            if "p50_ms" not in r:
                rows.append([config, name, r.get("error", r.get("skipped", "missing"))[:80]] + [""] * 8)
                continue
            parts = (f"{r['forward_backward_p50_ms']:.1f} / {r['optimizer_p50_ms']:.1f}"
                     if "optimizer_p50_ms" in r else "")
            # forward+backward alone: the like-for-like part (the optimizers differed until run 15)
            fwd_bwd = (f"{liger['forward_backward_p50_ms'] / r['forward_backward_p50_ms']:.3f}x"
                       if "forward_backward_p50_ms" in r and "forward_backward_p50_ms" in liger else "")
            rows.append([f"{config} (V={shape['vocab']})", name, f"{r['p50_ms']:.1f}", parts, f"{r['tokens_per_s']:.0f}",
                         f"{r['model_tflops']:.0f}", f"{r['peak_bytes'] / 2**30:.2f}",
                         f"{liger['p50_ms'] / r['p50_ms']:.3f}x" if "p50_ms" in liger else "",
                         f"{compiled['p50_ms'] / r['p50_ms']:.3f}x" if "p50_ms" in compiled else "",
                         fwd_bwd, " / ".join(f"{v:.3f}" for v in r["first_losses"])])
    out.append(_table(["config", "impl", "ms/step", "fwd+bwd / optimizer ms", "tokens/s", "model TFLOP/s",
                       "peak GiB", "vs HF+Liger",
                       "vs HF torch.compile", "fwd+bwd vs HF+Liger", "losses of steps 1-3"], rows))
    legend = _optimizer_legend(run["step"], "optimizer")
    if legend:
        out.append("")
        out.append("Optimizers (each row's `optimizer` field in the JSON; lr 1e-5, no clipping, weight decay 0.01): "
                   + legend + ". The whole-step ratios compare different optimizers where these differ (the "
                   "three-pass stand-in also holds 4 bytes per parameter of fp32 gradient buffers, in the peak); "
                   "`fwd+bwd vs HF+Liger` is the like-for-like part.\n")
    out.append("")
    if first_run:
        out.append("Before the harness copied v out of the QKV buffer and stored d_hidden in bf16 (run8/"
                   "step_first_run.json, same day), ours peaked at " + ", ".join(
                       f"{c}: {r['ours']['peak_bytes'] / 2**30:.2f} GiB" for c, r in first_run["step"].items()) + ".\n")


def convergence_section(out, run, plots):
    env, model = run["environment"], run["model"]
    out.append("### FP8 vs bf16 convergence (harness composition, ~100M LLaMA trained from scratch)\n")
    out.append(f"`{run['command']}` on {env['date']}, {env['device']}. Model: {model['num_hidden_layers']} layers x "
               f"{model['hidden_size']}, GQA {model['num_attention_heads']}/{model['num_key_value_heads']}, FFN "
               f"{model['intermediate_size']}, byte vocabulary {model['vocab_size']}: {model['parameters'] / 1e6:.1f}M "
               f"parameters. Data: {run['data']['files']} .py files of {run['data']['root']} "
               f"({run['data']['bytes'] / 1e6:.1f} MB; the last files, {run['data']['heldout_bytes'] / 1e3:.0f} kB, held "
               f"out). {run['setup']['tokens_per_step']} tokens per step, {run['setup']['optimizer']}, "
               f"{run['setup']['schedule']}; FP8: {run['setup']['fp8']}. Same initial weights and batches for every "
               f"run. Spike = a step after warm-up whose loss exceeds bf16's on the same batch by more than "
               f"{(SPIKE_RATIO - 1) * 100:.0f}%.\n")
    base = run["runs"]["bf16"]
    rows = []
    for name, r in run["runs"].items():
        spikes = same_batch_spikes(r["train_loss"], base["train_loss"])
        rows.append([name, len(r["train_loss"]), f"{r['final_train_loss_last100']:.4f}",
                     f"{(r['final_train_loss_last100'] / base['final_train_loss_last100'] - 1) * 100:+.2f}%",
                     f"{r['final_heldout_loss']:.4f}", f"{(r['final_heldout_loss'] / base['final_heldout_loss'] - 1) * 100:+.2f}%",
                     len(spikes["steps"]), f"{spikes['max_ratio']:.3f} (step {spikes['max_ratio_step']})",
                     len(r["nonfinite_steps"]), f"{r['seconds']:.0f}"])
    out.append(_table(["precision", "steps", "train loss (last 100)", "vs bf16", "held-out loss", "vs bf16",
                       "spikes", "max loss / bf16 loss", "non-finite steps", "seconds"], rows))
    out.append("")
    for plot in plots:
        out.append(f"![{plot.stem}]({plot.name})\n")


def plot_convergence(run, filename="gpu_convergence_fp8.png") -> list[Path]:
    plt = _pyplot()
    if plt is None:
        return []
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    window = 50
    for name, r in run["runs"].items():
        losses = r["train_loss"]
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(smooth, label=name, linewidth=1)
        ax2.plot([e["step"] for e in r["heldout"]], [e["heldout_loss"] for e in r["heldout"]], marker="o", label=name)
    ax.set_ylim(0.4, 2.0)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {window} steps)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("held-out loss")
    for a in (ax, ax2):
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle(f"{run['environment']['device']}: ~{run['model']['parameters'] / 1e6:.0f}M LLaMA, FP8 vs bf16")
    fig.tight_layout()
    path = RESULTS / filename
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_step(run, filename="gpu_step.png") -> list[Path]:
    plt = _pyplot()
    if plt is None:
        return []
    configs = list(run["step"])
    names = [n for n in ("hf_eager", "hf_torch_compile", "hf_liger", "hf_liger_amp", "ours", "ours_fp8_current",
                         "ours_fp8_delayed") if any(n in run["step"][c] for c in configs)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [run["step"][c].get(name, {}).get("tokens_per_s", 0) / 1e3 for c in configs]
        ax.bar([x + (i - (len(names) - 1) / 2) * width for x in range(len(configs))], values, width, label=name)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(configs)
    ax.set_ylabel("thousand tokens/s (whole training step)")
    ax.set_title(f"{run['environment']['device']}: 8-layer LLaMA training step, 8192 tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS / filename
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def run8_sections(out):
    load = _run_loader(RUN8)
    out.append("## GPU run 8 (NVIDIA H200, 2026-12-02): whole step, FP8 decoder layer, FP8 FFN grid, "
               "convergence\n")
    out.append("Standalone harness as above. Files and commits: run8/README.md.\n")
    step, first = load("step.json"), load("step_first_run.json")
    if step:
        step_section(out, step, first)
        for plot in plot_step(step):
            out.append(f"![{plot.stem}]({plot.name})\n")
        loss_section(out, step)
    dec = load("decoder.json")
    if dec:
        decoder8_section(out, dec)
    quant = load("fp8_quant_and_ffn_8192_a.json")
    if quant:
        quantization_section(out, quant)
    fixed, grid = load("fp8_ffn_8192_b.json"), load("fp8_ffn_grid.json")
    if quant and fixed and grid:
        fp8_grid_section(out, [
            ("LLaMA-2 7B and 13B at 8192 tokens", quant, lambda shape: shape[0] in ("llama2_7b", "llama2_13b")),
            ("Llama-3-8B and LLaMA-2 70B at 8192 tokens (rerun: in the first run dynamo's recompile limit made "
             "the compiled contenders fall back to eager at these widths)", fixed, lambda shape: True),
            ("every width at 2048 and 16384 tokens", grid, lambda shape: True)])
    conv = load("convergence.json")
    if conv:
        convergence_section(out, conv, plot_convergence(conv))


def projection_section(out, run):
    run_header(out, "Projection GEMMs: one GEMM on the fused weight vs one per part (8192 tokens, bf16)", run)
    out.append("Forward, input-gradient and weight-gradient GEMMs of each fused projection, interleaved timing. "
               "`split_torch` = Hugging Face's separate Linears (input gradient summed in place); "
               "`fused_provider` = the fused layout through our cuBLASLt provider (fastffn_gemm_cuda).\n")
    rows = [[r["model"], r["projection"], "+".join(str(p) for p in r["parts"]), r["impl"], f"{r['p50_ms']:.3f}",
             f"{r['tflops']:.0f}"] for r in run["projection_gemms"] if "p50_ms" in r]
    out.append(_table(["model", "projection", "N parts", "impl", "ms", "TFLOP/s"], rows))
    out.append("")


def norm_section(out, run):
    run_header(out, "RMSNorm kernels (8192 tokens, bf16, CUDA-graph replay)", run)
    rows = [[r["op"], r["model"], r["pass"], r["impl"], f"{r['p50_ms'] * 1e3:.1f}", f"{r['fraction_of_copy'] * 100:.0f}%"]
            for r in run["kernels"] if "rms" in r["op"] and "fraction_of_copy" in r and r["impl"] != "eager"]
    out.append(_table(["op", "widths", "pass", "impl", "µs", "of copy"], rows))
    out.append("")


def optimizer_section(out, run):
    run_header(out, "Optimizer step alone: our AdamW kernel vs the three-pass master-weight AdamW", run)
    out.append("The whole-step benchmark's trainable tensors, bf16 parameters with fp32 masters and moments. "
               "Bytes per parameter: ours 28 (bf16 grad, master, m, v read; master, m, v, bf16 param written), "
               "three-pass 40 (grads copied into fp32 buffers, torch's fused AdamW, masters copied back); the "
               "global-norm clip adds a read of each gradient (ours: bf16, +2; torch: fp32 norm and in-place "
               "scale, +12). Eager = step() from Python, CUDA events; graph = the step replayed from a CUDA graph. "
               "The three-pass update is the harness's stand-in, not what Paddle users run: stock Paddle's AdamW "
               "(multi_precision) is one pass at 28 bytes per parameter too; it is the baseline from run 15 on.\n")
    rows = []
    for config, results in run.items():
        if not isinstance(results, list):
            continue
        for r in results:
            if "error" in r:
                rows.append([config, r["impl"], r["clip"], "error: " + r["error"][:80], "", "", "", ""])
                continue
            eager, graph = r["eager"], r["graph"]
            rows.append([config, r["impl"], r["clip"], f"{r['parameters'] / 1e9:.2f} B x {r['bytes_per_parameter']} B",
                         f"{eager['p50_ms']:.2f}", f"{eager.get('fraction_of_copy', 0) * 100:.0f}%",
                         f"{graph['p50_ms']:.2f}" if "p50_ms" in graph else graph.get("error", "")[:60],
                         f"{graph['fraction_of_copy'] * 100:.0f}%" if "fraction_of_copy" in graph else ""])
    out.append(_table(["config", "impl", "clip", "params x bytes", "eager ms", "eager of copy", "graph ms",
                       "graph of copy"], rows))
    out.append("")


def fp8_profile_section(out, run):
    run_header(out, "Where our FP8 FFN's time goes (8192 tokens; torch.profiler kernel times per fwd+bwd)", run)
    out.append("Eager = the FFN table's timing (CUDA events around one fwd+bwd launched from Python); graph = the "
               "same fwd+bwd replayed from a CUDA graph (no host launch cost); kernels = the sum of every kernel's "
               "GPU time. Eager minus kernels is time the GPU waited for the host.\n")
    rows = []
    for r in run["profile"]:
        if "error" in r:
            rows.append([r["model"], r["impl"], "error: " + r["error"][:80]] + [""] * 5)
            continue
        others = [(name, t) for name, t in r["kernels_ms"].items()
                  if not any(m in name.lower() for m in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul"))]
        top = "; ".join(f"{name.replace('(anonymous namespace)::', '').split('<')[0].split('(')[0].replace('void ', '')[-40:]} "
                        f"{t * 1e3:.0f} µs"
                        for name, t in sorted(others, key=lambda kv: -kv[1])[:5])
        graph, timeline = r["graph_replay"], r.get("graph_timeline")
        row = [r["model"], r["impl"], f"{r['eager']['p50_ms']:.3f}",
               f"{graph['p50_ms']:.3f}" if "p50_ms" in graph else "error", f"{r['kernel_sum_ms']:.3f}",
               f"{r['gemm_ms']:.3f}", f"{r['kernel_sum_ms'] - r['gemm_ms']:.3f}", top]
        if any("graph_timeline" in q for q in run["profile"]):
            row.insert(4, f"{timeline['busy_ms']:.3f} / {timeline['idle_ms']:.3f}" if timeline else "")
        rows.append(row)
    header = ["widths", "impl", "eager ms", "graph ms", "kernels ms", "GEMMs ms", "other kernels ms",
              "largest other kernels"]
    if any("graph_timeline" in q for q in run["profile"]):
        header.insert(4, "replays: kernels busy / idle ms")
        out.append("Replays: five graph replays back to back under the profiler, per replay: the time some kernel "
                   "ran and the time none did (the graph's own gaps).\n")
    out.append(_table(header, rows))
    out.append("")


def optimizer_sweep_section(out, run):
    sweep = run.get("sweep")
    if not sweep:
        return
    out.append(f"Build-time knobs of csrc/kernels/cuda/adamw.cu (`--sweep`), {sweep['config']}'s parameters, no "
               "clipping, each build measured in the same run (the default build first and again last):\n")
    out.append(_table(["build defines", "eager ms", "graph ms", "graph of copy"],
                      [[", ".join(r["defines"]) or "(default)", f"{r['eager']['p50_ms']:.2f}",
                        f"{r['graph']['p50_ms']:.2f}", f"{r['graph']['fraction_of_copy'] * 100:.1f}%"]
                       for r in sweep["rows"]]))
    out.append("")


def step_profile_section(out, runs):
    """profile_step.json files (label, run): each contender's kernel timeline per step."""
    out.append("### Where the whole step's time goes: kernel timeline per step (torch.profiler, GPU only)\n")
    out.append("`python3 -m benchmarks.gpu.profile_step`: two profiled steps after bench_step's warm-up, per step: "
               "span from the first kernel to the last, busy = some kernel (or copy/memset) running, idle = none "
               "(the GPU waiting for the host, mostly after a synchronisation), kernel time by category. The "
               "profiler widens gaps a little; compare contenders of one run.\n")
    for label, run in runs:
        out.append(f"- {label}: `{run['command']}` on {run['environment']['date']}")
    out.append("")
    rows = []
    cats = ("gemm", "attention", "optimizer", "fastffn", "loss", "other")
    for label, run in runs:
        for config, results in run.items():
            if not isinstance(results, dict) or config in ("environment",):
                continue
            for name, r in results.items():
                g = r.get("gpu_only") if isinstance(r, dict) else None
                if not g:
                    continue
                k = g["kernel_ms_by_category"]
                rows.append([label, config, name, f"{g['span_ms']:.1f}", f"{g['busy_ms']:.1f}", f"{g['idle_ms']:.2f}",
                             f"{g['gaps_over_20us_per_step']:.1f}"] + [f"{k.get(c, 0.0):.2f}" for c in cats])
    out.append(_table(["run", "config", "impl", "span ms", "busy ms", "idle ms", "gaps > 20 µs"] +
                      [f"{c} ms" for c in cats], rows))
    out.append("")


def run9_sections(out):
    load = _run_loader(RUN9)
    out.append("## GPU run 9 (NVIDIA H200, 2026-12-02, next session): FP8 kernels at bandwidth, whole step "
               "with its optimizer share, projection GEMMs, norms\n")
    out.append("Standalone harness as above. Files, calls and commits: run9/README.md. The FP8 transposed "
               "stores write whole 128-byte lines, and the SwiGLU backward keeps its inputs packed so that two "
               "segments of loads are in flight per thread.\n")
    step = load("step.json")
    if step:
        step_section(out, step)
        loss_section(out, step)
    dec = load("decoder.json")
    if dec:
        decoder8_section(out, dec)
    fp8 = load("fp8_quant_and_ffn.json")
    if fp8:
        quantization_section(out, fp8)
        fp8_grid_section(out, [("every width at 8192 tokens", fp8, lambda shape: True)])
    kp = load("kernels_and_projections.json")
    if kp:
        projection_section(out, kp)
        norm_section(out, kp)


def run10_sections(out):
    load = _run_loader(RUN10)
    out.append("## GPU run 10 (NVIDIA H200, 2026-12-03): whole step with FastAdamW's kernel, FP8 decoder layer "
               "and FFN with the Paddle path's FP8 composition, the optimizer alone\n")
    out.append("Standalone harness as above, one device call; files and commit: run10/README.md. Since run 9: "
               "the one-pass AdamW kernel (ours in the step), the HF + Liger contender as Hugging Face's Trainer "
               "runs bf16 (`hf_liger_amp`: fp32 weights, autocast, torch's fused AdamW), the FP8 FFN as one "
               "composition (Paddle and harness), the delayed-scaling warm start, and FP8 FFN rows with four "
               "micro-batches per weight cast (`_accumulate4`: configs/llama2_7b_sft accumulates 4). Run 10's step.json "
               "records ours' optimizer text cut after its first line; in full: \"...: our kernel, the Paddle path's "
               "FastAdamW (llama_model.FusedMasterAdamW)\" (bench_step now records the whole paragraph).\n")
    step = load("step.json")
    if step:
        step_section(out, step)
        for plot in plot_step(step, "gpu_step_run10.png"):
            out.append(f"![{plot.stem}]({plot.name})\n")
        loss_section(out, step)
    dec = load("decoder.json")
    if dec:
        decoder8_section(out, dec)
    fp8 = load("fp8_ffn.json")
    if fp8:
        quantization_section(out, fp8)
        fp8_grid_section(out, [("every width at 8192 tokens", fp8, lambda shape: True)])
        fp8_profile_section(out, fp8)
    opt = load("optimizer.json")
    if opt:
        optimizer_section(out, opt)


def run11_sections(out):
    load = _run_loader(RUN11)
    bench, step, conv = load("gpu_bench.json"), load("step.json"), load("convergence.json")
    if not (bench or step or conv):
        return
    out.append("## GPU run 11 (NVIDIA H200, 2026-12-03, next session): the plain RMSNorm forward through a "
               "persistent kernel, the fused loss without its zero fill, FP8 convergence with the delayed-scaling "
               "warm start\n")
    out.append("Standalone harness as above; files, calls and commits: run11/README.md. The plain RMSNorm forward "
               "runs persistent blocks that hold their weight slice in registers and load the next row before "
               "reducing the current one (csrc/kernels/cuda/rms_norm.cu); the fused linear cross-entropy's first "
               "chunk initialises the weight gradient, which stays in the GEMM's dtype when there is one chunk. "
               "A register-resident backward built the same way measured slower and was reverted "
               "(run11/rms_norm_bwd_registers_rejected.json).\n")
    if bench and "kernels" in bench:
        norm_section(out, bench)
    if step:
        whole_step_sections(out, step, "gpu_step_run11.png")
    if bench and "decoder_layer" in bench:
        decoder8_section(out, bench)
    if conv:
        convergence_section(out, conv, plot_convergence(conv, "gpu_convergence_fp8_run11.png"))


def whole_step_sections(out, step, plot_name):
    """The whole-step table, its plot and the fused-loss table of one run's step.json."""
    step_section(out, step)
    for plot in plot_step(step, plot_name):
        out.append(f"![{plot.stem}]({plot.name})\n")
    loss_section(out, step)


def run12_sections(out):
    load = _run_loader(RUN12)
    step, bench, fp8, opt = load("step.json"), load("gpu_bench.json"), load("fp8_ffn.json"), load("optimizer.json")
    before, after = load("profile_step_before.json"), load("profile_step.json")
    if not (step or bench or fp8 or opt):
        return
    out.append("## GPU run 12 (NVIDIA H200, 2026-12-03, third session): one synchronisation per pass in the "
               "fused loss, the optimizer's grid, a flat amax pass, where the whole step's time goes\n")
    out.append("Standalone harness as above; files, calls and commits: run12/README.md. Since run 11: the fused "
               "linear cross-entropy (Paddle op and harness) synchronises once in the forward (the label count) "
               "and once in backward (upstream gradient, kept count and label flag in one copy) instead of four "
               "times and once; the AdamW kernel runs 8 blocks per SM (the sweep below); current scaling's "
               "amax-only pass over a contiguous tensor is a flat kernel.\n")
    if step:
        step_section(out, step)
        for plot in plot_step(step, "gpu_step_run12.png"):
            out.append(f"![{plot.stem}]({plot.name})\n")
    if before and after:
        step_profile_section(out, [("before (fused loss with 5 synchronisations)", before),
                                   ("after (2 synchronisations)", after)])
    if step:
        loss_section(out, step)
    if bench and "decoder_layer" in bench:
        decoder8_section(out, bench)
    kernels, quantization = load("kernels.json"), load("fp8_quantization.json")
    if kernels:
        norm_section(out, kernels)
    for run in (fp8, quantization):  # calls 5 and 7: the same kernels, measured twice (the spread)
        if run and "quantization_kernels" in run:
            quantization_section(out, run)
    if fp8:
        fp8_profile_section(out, fp8)
    if opt:
        optimizer_section(out, opt)
        optimizer_sweep_section(out, opt)


def saved_gate_up_section(out, run):
    """The FP8 FFN with gate_up's FP8 copy saved for backward (the default) against the 16-bit
    gate_up (`_gate_up_activation` rows), same run."""
    out.append("### FP8 FFN: gate_up saved for backward in FP8 (default) or in bf16, same run\n")
    out.append("Activation memory held for backward, as a fraction of eager bf16's (target 0.35x), and the time "
               "each costs. `saved_gate_up` is `Fp8Recipe.saved_gate_up` (`fast_ffn_fp8_saved_gate_up`).\n")
    rows = []
    for (model, tokens), d in _by_shape(run["ffn"]).items():
        eager_saved, bf16 = d["eager_bf16"]["saved_activation_bytes"], d["ours_bf16"]["p50_ms"]
        for kind in ("current", "delayed"):
            fp8, act = d[f"ours_fp8_{kind}"], d[f"ours_fp8_{kind}_gate_up_activation"]
            rows.append([model, tokens, kind, f"{fp8['p50_ms']:.2f}", f"{act['p50_ms']:.2f}",
                         f"{(fp8['p50_ms'] / act['p50_ms'] - 1) * 100:+.1f}%",
                         f"{bf16 / fp8['p50_ms']:.2f}x / {bf16 / act['p50_ms']:.2f}x",
                         f"{fp8['saved_activation_bytes'] / eager_saved:.3f}", f"{act['saved_activation_bytes'] / eager_saved:.3f}"])
    out.append(_table(["model", "tokens", "scaling", "fp8 gate_up ms", "bf16 gate_up ms", "time of the FP8 copy",
                       "vs ours bf16 (fp8 / bf16 gate_up)", "saved act. vs eager (fp8 gate_up)",
                       "same (bf16 gate_up)"], rows))
    out.append("")


def run13_sections(out):
    load = _run_loader(RUN13)
    fp8, conv, bench, step = load("fp8_ffn.json"), load("convergence.json"), load("gpu_bench.json"), load("step.json")
    if not (fp8 or conv or bench or step):
        return
    out.append("## GPU run 13 (NVIDIA H200, 2026-12-04): the FP8 FFN saves gate_up's FP8 copy for backward\n")
    out.append("Standalone harness as above; files, calls and commits: run13/README.md. Since run 12: the SwiGLU "
               "forward kernel also writes gate_up's own per-tensor scaled e4m3 copy (its amax pass gives both "
               "amaxes), and the SwiGLU backward reads that copy instead of the 16-bit gate_up "
               "(`Fp8Recipe.saved_gate_up = \"fp8\"`, the default; `\"activation\"` keeps the 16-bit gate_up).\n")
    if step:
        whole_step_sections(out, step, "gpu_step_run13.png")
    if fp8:
        saved_gate_up_section(out, fp8)
        fp8_grid_section(out, [("every width at 8192 tokens", fp8, lambda shape: True)])
        quantization_section(out, fp8)
    if bench and "decoder_layer" in bench:
        decoder8_section(out, bench)
    if conv:
        convergence_section(out, conv, plot_convergence(conv, "gpu_convergence_fp8_run13.png"))


def rms_occupancy_section(out, run):
    run_header(out, "RMSNorm forward: the persistent kernel (default) or one row per block at full occupancy "
                    "(FASTFFN_RMS_NORM_FULL_OCCUPANCY=1, rejected), Liger beside them", run)
    rows = [[r["op"], r["model"], " ".join(r.get("defines", [])) or r.get("impl", "default"),
             f"{r['p50_ms'] * 1e3:.1f}", f"{r['fraction_of_copy'] * 100:.0f}%"] for r in run["rms_norm_occupancy"]]
    out.append(_table(["op", "widths", "build / impl", "µs", "of copy"], rows))
    out.append("")


def run14_sections(out):
    load = _run_loader(RUN14)
    fp8, bench, step = load("fp8_ffn.json"), load("gpu_bench.json"), load("step.json")
    whole_tile, rms = load("fp8_ffn_call1_quantize_whole_tile_rejected.json"), load("rms_norm_occupancy_rejected.json")
    if not (fp8 or bench or step):
        return
    out.append("## GPU run 14 (NVIDIA H200, 2026-12-04, second session): the FP8 tile kernels load one segment "
               "ahead\n")
    out.append("Standalone harness as above; files, calls and commits: run14/README.md. Since run 13: the SwiGLU "
               "forward and cast/transpose kernels issue the next segment's loads (the next tile's first after a "
               "tile's last) before the current segment's FP8 stores, which the compiler may not reorder "
               "(a uint8_t store may alias the inputs). The sweep tables compare each build with the earlier "
               "order, FASTFFN_FP8_PREFETCH=0, in the same call (a build option of commit 384e920 only).\n")
    if step:
        whole_step_sections(out, step, "gpu_step_run14.png")
    if bench and "decoder_layer" in bench:
        decoder8_section(out, bench)
    if fp8:
        prefetch_sweep_section(out, fp8)
        fp8_grid_section(out, [("every width at 8192 tokens", fp8, lambda shape: True)])
        saved_gate_up_section(out, fp8)
        quantization_section(out, fp8)
    if whole_tile:
        out.append("Rejected in call 1: cast/transpose loading a whole tile (four segments) ahead, 117-127 registers "
                   "and two blocks per SM (the SwiGLU forward as in call 2):\n")
        prefetch_sweep_section(out, whole_tile)
    if rms:
        rms_occupancy_section(out, rms)


# --- like-for-like tables (run 15 on): median (spread), the best peer by measurement, ties ----------

def _median(r) -> str:
    """'median (spread)' in ms of a timing row, or its error."""
    if not timed(r):
        return "error: " + str((r or {}).get("error", "missing"))[:60]
    return f"{r['p50_ms']:.3f} ({spread_ms(r):.3f})"


def _versus(rows: dict, ours: str, peers) -> str:
    """ours against the fastest of `peers` in the same table: 'peer: 1.047x faster' or '... (tie)'."""
    result = against_best_peer(rows, ours, peers)
    if result is None:
        return "-"
    word = "tie" if result["verdict"] == "tie" else result["verdict"]
    return f"{result['peer']}: {result['speedup']:.3f}x, {word}"


def _run_line(run) -> str:
    env = run["environment"]
    versions = ", ".join(f"{name} {env[key]}" for key, name in (
        ("torch", "torch"), ("liger_kernel", "Liger-Kernel"), ("transformers", "transformers"),
        ("torchao", "torchao")) if env.get(key))
    line = f"`{run['command']}` on {env['date']}, {env['device']} ({versions})."
    if run.get("ceilings"):
        ceil = run["ceilings"]
        line += (f" Ceilings in the same run: device copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), "
                 f"bf16 GEMM 8192^3 {ceil['bf16_gemm_tflops']:.0f} TFLOP/s.")
    return line + "\n"


def _rows_by(rows, key):
    by = {}
    for r in rows:
        by.setdefault(tuple(r.get(k) for k in key), {})[r["impl"]] = r
    return by


def _is_ours(name: str) -> bool:
    return name.startswith("ours")


KERNEL_TABLE_NOTE = ("ms = median (spread) of round-robin repeats of graph replays after an L2 flush; of copy = "
                     "bytes (each input read once, each output written once) / time, against the copy bandwidth.")


def like_for_like_kernels(out, run, key="kernels",
                          title="bf16 kernels: ours against eager and Liger, each in its users' layout (CUDA graph replay)",
                          note="Rotary: Hugging Face's rope and Liger's get q/k as HF hands them, transposed views of "
                               "[b, s, h, d] (upstream gradients likewise); ours reads [b, s, h, d]."):
    """bench_gpu's kernel rows (record_kernel_rows) under run[key]: one table, each of ours against
    the fastest peer of its (op, widths, pass)."""
    out.append(f"### {title}\n")
    out.append(_run_line(run))
    out.append(f"{note} {KERNEL_TABLE_NOTE}\n")
    rows = []
    for (op, model, pass_name), d in _rows_by(run[key], ("op", "model", "pass")).items():
        peers = [n for n in d if not _is_ours(n)]
        for name, r in d.items():
            rows.append([op, model, pass_name, name, _median(r),
                         f"{r['fraction_of_copy'] * 100:.0f}%" if "fraction_of_copy" in r else "",
                         _versus(d, name, peers) if _is_ours(name) else ""])
    out.append(_table(["op", "widths", "pass", "impl", "ms (spread)", "of copy", "vs best peer"], rows))
    out.append("")


def like_for_like_decoder(out, run):
    out.append("### Decoder layer forward+backward (round-robin, Liger's patch entered around its own calls)\n")
    out.append(_run_line(run))
    rows = []
    peers = ("hf_eager", "hf_torch_compile", "hf_liger")
    for config, results in run["decoder_layer"].items():
        for name, r in results.items():
            if name == "shape":
                continue
            rows.append([config, name, _median(r), f"{r['model_tflops']:.0f}" if "model_tflops" in r else "",
                         f"{r['peak_bytes'] / 2**30:.2f}" if "peak_bytes" in r else "",
                         _versus(results, name, peers) if _is_ours(name) else ""])
    out.append(_table(["layer", "impl", "ms (spread)", "model TFLOP/s", "peak GiB", "vs best peer"], rows))
    out.append("")


def like_for_like_loss(out, run):
    out.append("### LM head + cross-entropy forward+backward (8192 tokens x 4096; round-robin)\n")
    rows = []
    for (vocab,), d in _rows_by([r for r in run["loss"] if "impl" in r and r["impl"] != "reference_sizes"],
                                ("vocab",)).items():
        for name, r in d.items():
            rows.append([vocab, name, _median(r), f"{r['peak_bytes'] / 2**30:.2f}" if "peak_bytes" in r else "",
                         _versus(d, name, [n for n in d if not _is_ours(n)]) if _is_ours(name) else ""])
    out.append(_table(["vocab", "impl", "ms (spread)", "peak GiB", "vs best peer"], rows))
    out.append("")


STEP_PEERS = ("hf_eager", "hf_liger", "hf_liger_amp", "hf_torch_compile")


def like_for_like_step(out, run):
    out.append("### Whole training step, the same optimizer for every bf16-weight contender; forward+backward and "
               "optimizer apart\n")
    out.append(_run_line(run))
    out.append("Embedding, 8 decoder layers, norm, LM head + loss and AdamW, 8192 tokens per step. Ours and the "
               "Hugging Face models with bf16 weights (eager, Liger, torch.compile) all step the one-pass master-weight "
               "AdamW kernel (llama_model.FusedMasterAdamW); hf_liger_amp is Hugging Face's Trainer in bf16 (fp32 "
               "weights, autocast, torch's fused AdamW). Round-robin over whole contenders: each round builds, times "
               "and frees each one; ms = median over rounds of each round's median step (spread over rounds).\n")
    rows = []
    for config, results in run["step"].items():
        parts = {part: {n: r[part] for n, r in results.items() if isinstance(r, dict) and timed(r.get(part))}
                 for part in ("forward_backward", "optimizer")}
        for name, r in results.items():
            if name == "shape" or not isinstance(r, dict):  # rounds_so_far: a run cut short
                continue
            if not timed(r):
                rows.append([config, name, _median(r)] + [""] * 6)
                continue
            rows.append([config, name, _median(r), _median(r["forward_backward"]), _median(r["optimizer"]),
                         f"{r['tokens_per_s']:.0f}", f"{r['peak_bytes'] / 2**30:.2f}",
                         _versus(results, name, STEP_PEERS) if _is_ours(name) else "",
                         _versus(parts["forward_backward"], name, STEP_PEERS) if _is_ours(name) else ""])
    out.append(_table(["config", "impl", "step ms (spread)", "fwd+bwd ms", "optimizer ms", "tokens/s", "peak GiB",
                       "step vs best peer", "fwd+bwd vs best peer"], rows))
    out.append("")
    out.append("Optimizers (lr 1e-5, no clipping, weight decay 0.01): " + _optimizer_legend(run["step"], "optimizer_used")
               + "\n")


def like_for_like_optimizer(out, run):
    out.append("### Optimizer step alone: ours against stock Paddle's AdamW (ported), with and without the "
               "global-norm clip\n")
    out.append(_run_line(run))
    out.append("paddle = Paddle 3.3.1's AdamW (multi_precision) and ClipGradByGlobalNorm as its dygraph runs them, "
               "ported into the harness (benchmarks/gpu/paddle_adamw.py, paddle_adamw.cu); three_pass = the stand-in "
               "of runs up to 14. Graph = the step replayed from a CUDA graph (the GPU's time, compared); eager = "
               "step() from Python. Round-robin over rebuilt contenders.\n")
    rows = []
    for config, results in run.items():
        if not isinstance(results, dict) or config in ("environment", "ceilings", "sweep"):
            continue
        for clip in (False, True):
            group = {n: r for n, r in results.items() if isinstance(r, dict) and n.endswith("_clip") == clip}
            for name, r in group.items():
                if "parameters" not in r:
                    rows.append([config, name, _median(r)] + [""] * 5)
                    continue
                rows.append([config, name, f"{r['parameters'] / 1e9:.2f} B x {r['bytes_per_parameter']} B",
                             _median(r.get("graph")), f"{r['graph'].get('fraction_of_copy', 0) * 100:.0f}%"
                             if isinstance(r.get("graph"), dict) else "", _median(r.get("eager")),
                             _versus(group, name, [n for n in group if not _is_ours(n)]) if _is_ours(name) else ""])
    out.append(_table(["config", "impl", "params x bytes", "graph ms (spread)", "graph of copy", "eager ms (spread)",
                       "vs best peer (graph)"], rows))
    out.append("")


def like_for_like_fp8(out, run):
    out.append("### FP8 FFN forward+backward (round-robin), and 4 micro-batches per optimizer step in the same loop "
               "for every contender\n")
    out.append(_run_line(run))
    out.append("`_accumulate4` rows: 4 calls after one L2 flush and one synchronisation for every contender (ms per "
               "micro-batch); ours FP8 quantises its weights at the first of the four, torchao at every call.\n")
    rows = []
    for (model, tokens), d in _rows_by(run["ffn"], ("model", "tokens")).items():
        for accumulate in (False, True):
            group = {n: r for n, r in d.items() if ("_accumulate" in n) == accumulate and n != "six_fp8_gemms_alone"}
            for name, r in group.items():
                rows.append([model, tokens, name, _median(r), f"{r['tflops']:.0f}" if "tflops" in r else "",
                             _versus(group, name, [n for n in group if not _is_ours(n)]) if _is_ours(name) else ""])
        if "six_fp8_gemms_alone" in d:
            rows.append([model, tokens, "six_fp8_gemms_alone (floor)", _median(d["six_fp8_gemms_alone"]), "", ""])
    out.append(_table(["model", "tokens", "impl", "ms (spread)", "TFLOP/s", "vs best peer"], rows))
    out.append("")


def like_for_like_packed_sft(out, run):
    """bench_packed_sft's table: per length profile, each contender's step on the same examples, and
    ours packed against each peer in labelled tokens/s with issue 22's targets."""
    out.append("### Packed SFT step on real length profiles (LLaMA-2-7B width, 8 layers, rows of "
               f"{run['model']['seq']} tokens)\n")
    out.append(_run_line(run))
    out.append("A step is a fixed set of examples (those of the first zero_padding rows of the profile in shuffled order, "
               "PaddleNLP's truncation, labels on responses only); every contender trains the same ids and labels, so "
               "the labelled tokens per step are equal and tokens/s compare step times. ours_packed: FastLlama on the "
               "zero_padding rows, FlexAttention with a document mask over cu_seqlens standing in for Paddle's "
               "flash_attn_unpadded; hf_liger_padding_free: Hugging Face + Liger, flex_attention, one flattened row "
               "(DataCollatorWithFlattening); hf_liger_padded: Hugging Face + Liger, sdpa, micro-batches padded to "
               "their longest with gradient accumulation. Every contender steps the one-pass master-weight AdamW "
               "kernel. ms = median over round-robin rounds of each round's median step (spread).\n")
    rows, verdicts = [], []
    for profile, section in run["packed_sft"].items():
        step, results = section["step"], section.get("results", {})
        for name, r in results.items():
            if not timed(r):
                rows.append([profile, name, _median(r)] + [""] * 6)
                continue
            slots = step["token_slots"][r["layout"]]
            rows.append([profile, name, _median(r), _median(r["forward_backward"]), _median(r["optimizer"]),
                         f"{r['labelled_tokens_per_s']:.0f}", f"{r['peak_bytes'] / 2**30:.2f}",
                         f"{slots} ({1 - step['real_tokens'] / slots:.0%} padding)", f"{r['first_losses'][0]:.4f}"])
        for peer, c in section.get("comparison", {}).items():
            verdicts.append([profile, peer, f"{c['speedup']:.3f}x ({c['verdict']})", f"{c['target']:.2f}x",
                             "met" if c["meets_target"] else "not met", f"{c['first_loss_relative_difference']:.1e}"])
        out.append(f"{profile}: {step['examples']} examples, {step['labelled_tokens']} labelled of "
                   f"{step['real_tokens']} tokens per step; packed {step['packed_shape']}, padded micro-batches of "
                   f"{step['padded_batch_size']}.\n")
    out.append(_table(["profile", "contender", "step ms (spread)", "fwd+bwd ms", "optimizer ms", "labelled tokens/s",
                       "peak GiB", "token slots", "first loss"], rows))
    out.append("")
    if verdicts:
        out.append(_table(["profile", "ours_packed vs", "speedup (labelled tokens/s)", "target", "met",
                           "first-loss difference"], verdicts))
        out.append("")


FULL_DEPTH_PEERS = ("hf_liger", "hf_liger_peft")


def full_depth_section(out, run):
    """bench_full_depth's tables: per workload (LoRA, full fine-tune) and data (a packed length
    profile or uniform rows) each contender's step at full depth, labelled tokens/s, model TFLOP/s,
    peak memory, whether it recomputed layers and why, out-of-memory rows with what they asked for
    against what was free, and workloads whose state does not fit the card."""
    from benchmarks.full_depth import describe_oom, gib

    shape = run["shape"]
    model = run.get("model", "llama2_7b")
    out.append(f"### The user's job at full depth: {model} on one GPU ({shape['layers']} layers, rows of "
               f"{shape['seq']} tokens): LoRA and full fine-tune\n")
    out.append(_run_line(run))
    conventions = run.get("conventions", {})
    out.append(f"{shape['parameters'] / 1e9:.2f} B parameters; LoRA: rank {shape.get('lora_rank', 8)}, alpha "
               f"{shape.get('lora_alpha', 16)} on q/k/v/o/gate/up/down ({shape['lora_parameters'] / 1e6:.1f} M "
               f"trainable), base frozen in bf16; full fine-tune: bf16 weights, fp32 masters and moments. Every "
               f"contender steps the one-pass master-weight AdamW kernel. Model TFLOP/s: "
               f"{conventions.get('model_tflops', '')}. Timing: {conventions.get('timing', '')}. Peak = max "
               f"allocated over one step (weights, optimizer state, gradients, activations).\n")
    for workload, result in run["workloads"].items():
        if "contenders" not in result:
            out.append(f"{workload}: " + str(result.get("error", "no results (a run cut short: rounds_so_far)"))[:200]
                       + "\n")
            continue
        contenders, rows = result["contenders"], []
        peers = [n for n in contenders if n.startswith(FULL_DEPTH_PEERS)]
        for name, r in contenders.items():
            if r.get("oom"):
                rows.append([workload, name, describe_oom(r)] + [""] * 7)
                continue
            if r.get("does_not_fit"):
                rows.append([workload, name, f"does not fit: state {gib(r['persistent_state_bytes'])} > "
                             f"{gib(r['device_bytes'])} (short by {gib(r['short_by_bytes'])})"] + [""] * 7)
                continue
            if not timed(r):
                rows.append([workload, name, _median(r)] + [""] * 7)
                continue
            recompute = ("full recompute per layer (" + r.get("recompute_because", "") + ")"
                         if r.get("layer_recompute") else "none")
            rate = r.get("labelled_tokens_per_s", r["tokens_per_s"])
            rows.append([workload, name, _median(r), _median(r["forward_backward"]), _median(r["optimizer"]),
                         f"{rate:.0f}", f"{r['model_tflops']:.0f}", f"{r['peak_bytes'] / 2**30:.2f}", recompute,
                         _versus(contenders, name, peers) if _is_ours(name) else ""])
        out.append(_table(["workload:data", "contender", "step ms (spread)", "fwd+bwd ms", "optimizer ms",
                           "labelled tokens/s", "model TFLOP/s", "peak GiB", "layer recompute", "step vs best peer"],
                          rows))
        out.append("")
        if result.get("first_step_losses"):
            out.append(f"{workload}: first-step losses (same weights and tokens) "
                       + ", ".join(f"{n} {v:.4f}" for n, v in result["first_step_losses"].items())
                       + f"; largest relative difference {result['first_step_loss_max_relative_difference'] or 0:.1e}.\n")


def like_for_like_sections(out, run):
    """The run folder's tables (any of gpu_bench.json, step.json, optimizer.json, fp8_ffn.json,
    packed_sft.json, full_depth.json)."""
    load = _run_loader(run)
    bench, step, optimizer, fp8 = load("gpu_bench.json"), load("step.json"), load("optimizer.json"), load("fp8_ffn.json")
    packed_sft, full_depth = load("packed_sft.json"), load("full_depth.json")
    if not (bench or step or optimizer or fp8 or packed_sft or full_depth
            or any((RESULTS / run).glob("full_depth_*.json"))):
        return
    out.append(f"## GPU {run}: like for like (peers as their users set them up; {run}/README.md)\n")
    out.append(f"Each row: the median over round-robin repeats and, in parentheses, their spread; `vs best peer` "
               f"names the fastest peer of that table by measurement. {TIE_RULE}\n")
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
    for path in sorted((RESULTS / run).glob("full_depth_*.json")):  # one file per model
        per_model = load(path.name)
        if "workloads" in per_model:
            full_depth_section(out, per_model)


def plot_kernels(gpu) -> list[Path]:
    plt = _pyplot()
    if plt is None:
        return []
    rows = [r for r in gpu["kernels"] if "fraction_of_copy" in r and r["model"] == "7B"]
    labels = sorted({(r["op"], r["pass"]) for r in rows}, key=lambda x: (x[0], x[1]))
    impls = ["eager", "liger", "ours"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.27
    for i, impl in enumerate(impls):
        values = []
        for op, pas in labels:
            match = [r for r in rows if r["op"] == op and r["pass"] == pas and r["impl"] == impl]
            values.append(match[0]["fraction_of_copy"] * 100 if match else 0)
        ax.bar([x + (i - 1) * width for x in range(len(labels))], values, width, label=impl)
    ax.axhline(85, color="gray", linestyle="--", linewidth=1, label="85% target")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{op}\n{pas}" for op, pas in labels], fontsize=8)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title(f"{gpu['environment']['device']}: memory-bound kernels at LLaMA-2 7B widths, 8192 tokens, bf16")
    ax.legend()
    fig.tight_layout()
    path = RESULTS / "gpu_kernels_7b.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main():
    out = ["# paddle_fastffn benchmark report", "",
           "Generated by `python -m benchmarks.report` from the JSON files in this folder; each JSON "
           "records its command, date, device and versions.", ""]
    cpu_sections(out)
    like_for_like_sections(out, RUN17)
    like_for_like_sections(out, RUN15)
    like_for_like_sections(out, RUN16)
    cpu_lengths_section(out)
    run14_sections(out)
    run13_sections(out)
    run12_sections(out)
    run11_sections(out)
    run10_sections(out)
    run9_sections(out)
    run8_sections(out)
    kernels_run, ffn_run = _load("gpu_h200_run7.json"), _load("gpu_h200.json")
    if kernels_run and ffn_run:
        gpu_sections(out, kernels_run, ffn_run, plot_kernels(kernels_run))
    fp8 = _load("gpu_h200_fp8_ffn.json")
    if fp8:
        fp8_section(out, fp8)
    (RESULTS / "REPORT.md").write_text("\n".join(out) + "\n")
    print(f"wrote {RESULTS / 'REPORT.md'}")


if __name__ == "__main__":
    main()
