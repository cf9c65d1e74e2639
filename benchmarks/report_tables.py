"""The GPU tables of REPORT.md, each rendered from one results file's dict: every row is the median
over round-robin repeats with its spread, and each of ours is compared with the fastest peer of its
table by measurement under the tie rule (benchmarks/common.py). benchmarks/report.py picks the files."""

from __future__ import annotations

from benchmarks.common import against_best_peer, spread_ms, timed


def table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]  # "gate|up"
    return "\n".join(lines)


def _median(r) -> str:
    """'median (spread)' in ms of a timing row, or its error."""
    if not timed(r):
        return "error: " + str((r or {}).get("error", "missing"))[:60]
    digits = 1 if r["p50_ms"] >= 100 else 2 if r["p50_ms"] >= 10 else 3  # four significant figures or so
    return f"{r['p50_ms']:.{digits}f} ({spread_ms(r):.{digits}f})"


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


PEER_ROWS_NOTE = "Rows: ours and any contender that failed; each peer's own timing is in the JSON."


def _ours_and_failures(rows: dict) -> dict:
    """The rows of a table a reader compares: ours, and peers that did not time (their error)."""
    return {name: r for name, r in rows.items() if _is_ours(name) or not timed(r)}


KERNEL_TABLE_NOTE = ("ms = median (spread) of round-robin repeats of graph replays after an L2 flush; of copy = "
                     "bytes (each input read once, each output written once) / time, against the copy bandwidth.")


def like_for_like_kernels(out, run, key="kernels",
                          title="bf16 kernels: ours against eager and Liger, each in its users' layout (CUDA graph replay)",
                          note="Rotary: Hugging Face's rope and Liger's get q/k as HF hands them, transposed views of "
                               "[b, s, h, d] (upstream gradients likewise); ours reads [b, s, h, d]."):
    """bench_gpu's kernel rows (record_kernel_rows) under run[key]: one table, each of ours against
    the fastest peer of its (op, widths, pass). Only ours and the peers that failed get a row: the
    comparison names the best peer, and every peer's own timing is in the JSON."""
    out.append(f"### {title}\n")
    out.append(_run_line(run))
    out.append(f"{note} {KERNEL_TABLE_NOTE} {PEER_ROWS_NOTE}\n")
    rows = []
    for (op, model, pass_name), d in _rows_by(run[key], ("op", "model", "pass")).items():
        peers = [n for n in d if not _is_ours(n)]
        for name, r in _ours_and_failures(d).items():
            rows.append([op, model, pass_name, name, _median(r),
                         f"{r['fraction_of_copy'] * 100:.0f}%" if "fraction_of_copy" in r else "",
                         _versus(d, name, peers) if _is_ours(name) else ""])
    out.append(table(["op", "widths", "pass", "impl", "ms (spread)", "of copy", "vs best peer"], rows))
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
    out.append(table(["layer", "impl", "ms (spread)", "model TFLOP/s", "peak GiB", "vs best peer"], rows))
    out.append("")


def like_for_like_loss(out, run):
    out.append("### LM head + cross-entropy forward+backward (8192 tokens x 4096; round-robin)\n")
    rows = []
    for (vocab,), d in _rows_by([r for r in run["loss"] if "impl" in r and r["impl"] != "reference_sizes"],
                                ("vocab",)).items():
        for name, r in d.items():
            rows.append([vocab, name, _median(r), f"{r['peak_bytes'] / 2**30:.2f}" if "peak_bytes" in r else "",
                         _versus(d, name, [n for n in d if not _is_ours(n)]) if _is_ours(name) else ""])
    out.append(table(["vocab", "impl", "ms (spread)", "peak GiB", "vs best peer"], rows))
    out.append("")


STEP_PEERS = ("hf_eager", "hf_liger", "hf_liger_amp", "hf_torch_compile")


def _optimizer_legend(step_results, key) -> str:
    """'contenders: optimizer description; ...' from each step row's `key` field (a text)."""
    optimizers = {}
    for results in step_results.values():
        for name, r in results.items():
            if isinstance(r, dict) and timed(r) and isinstance(r.get(key), str):
                optimizers.setdefault(r[key], []).append(name)
    return "; ".join(f"{', '.join(dict.fromkeys(names))}: {text.rstrip('.')}" for text, names in optimizers.items())


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
    out.append(table(["config", "impl", "step ms (spread)", "fwd+bwd ms", "optimizer ms", "tokens/s", "peak GiB",
                       "step vs best peer", "fwd+bwd vs best peer"], rows))
    out.append("")
    out.append("Optimizers (lr 1e-5, no clipping, weight decay 0.01): " + _optimizer_legend(run["step"], "optimizer_used")
               + "\n")
    gemm_tuning_table(out, run["step"])


def gemm_tuning_table(out, step):
    """The GEMM problems the _tuned contenders tuned (each problem once per process: its first
    contender's first round), the heuristic's first choice against the winner."""
    rows = []
    for config, results in step.items():
        for name, r in results.items():
            for t in (r.get("gemm_tuning") or []) if isinstance(r, dict) else []:
                first, chosen = t.get("first_choice_config"), t.get("chosen_config")  # absent: older records
                rows.append([config, name, f"{t['m']} x {t['n']} x {t['k']}", " x ".join(t["dtypes"][:2]) + " -> "
                             + t["dtypes"][2], "yes" if t["fast_accum"] else "", "yes" if t["accumulate"] else "",
                             f"{t['candidates_timed']}/{t['candidates_asked']}", t["chosen_rank"],
                             f"{t['first_choice_ms']:.3f}", f"{t['chosen_ms']:.3f}",
                             f"{t['first_choice_ms'] / t['chosen_ms']:.3f}x" if t["chosen_ms"] else "",
                             _algo(first), _algo(chosen)])
    if not rows:
        return
    out.append("GEMM tuning (fastffn_gemm_set_tuning): each problem's candidates timed at its first call, in the first "
               "contender that met it; the heuristic's first choice (rank 0) against the winner, median of 5 rounds. "
               "Algorithm: cuBLASLt's algorithm id / tile / stages / split-K / cluster shape ids.\n")
    out.append(table(["config", "first met by", "M x N x K", "dtypes", "fast accum", "accumulate", "timed/asked",
                      "winner rank", "first choice ms", "winner ms", "speed-up", "first choice algorithm",
                      "winner algorithm"], rows))
    out.append("")


def _algo(config: dict | None) -> str:
    if not config:
        return ""
    return "/".join(str(config[k]) for k in ("algorithm_id", "tile_id", "stages_id", "split_k", "cluster_shape_id"))


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
    out.append(table(["config", "impl", "params x bytes", "graph ms (spread)", "graph of copy", "eager ms (spread)",
                       "vs best peer (graph)"], rows))
    out.append("")


def like_for_like_fp8(out, run):
    out.append("### FP8 FFN forward+backward (round-robin)\n")
    out.append(_run_line(run))
    out.append("The run's `_accumulate4` rows (4 micro-batches per optimizer step: ours FP8 quantises its weights at "
               "the first of the four, torchao at every call; compared only among themselves) are in its JSON. "
               f"{PEER_ROWS_NOTE}\n")
    rows = []
    for (model, tokens), d in _rows_by(run["ffn"], ("model", "tokens")).items():
        group = {n: r for n, r in d.items() if "_accumulate" not in n and n != "six_fp8_gemms_alone"}
        for name, r in _ours_and_failures(group).items():
            rows.append([model, tokens, name, _median(r), f"{r['tflops']:.0f}" if "tflops" in r else "",
                         _versus(group, name, [n for n in group if not _is_ours(n)]) if _is_ours(name) else ""])
        if "six_fp8_gemms_alone" in d:
            rows.append([model, tokens, "six_fp8_gemms_alone (floor)", _median(d["six_fp8_gemms_alone"]), "", ""])
    out.append(table(["model", "tokens", "impl", "ms (spread)", "TFLOP/s", "vs best peer"], rows))
    out.append("")


def like_for_like_packed_sft(out, run):
    """bench_packed_sft's table: per length profile, each contender's step on the same examples, and
    ours packed against each peer in labelled tokens/s with bench_packed_sft's TARGETS."""
    out.append("### Packed SFT step on real length profiles (LLaMA-2-7B width, 8 layers, rows of "
               f"{run['model']['seq']} tokens)\n")
    out.append(_run_line(run))
    out.append("A step is a fixed set of examples (those of the first zero_padding rows of the profile in shuffled order, "
               "PaddleNLP's truncation, labels on responses only); every contender trains the same ids and labels, so "
               "tokens/s compare step times. hf_liger_padding_free: one flattened row; hf_liger_padded: micro-batches "
               "padded to their longest with gradient accumulation. " + (run["note"].rstrip(".") + ". " if run.get("note")
                                                                          else "")
               + "ms = median over round-robin rounds of each round's median step (spread).\n")
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
    out.append(table(["profile", "contender", "step ms (spread)", "fwd+bwd ms", "optimizer ms", "labelled tokens/s",
                       "peak GiB", "token slots", "first loss"], rows))
    out.append("")
    if verdicts:
        out.append(table(["profile", "ours_packed vs", "speedup (labelled tokens/s)", "target", "met",
                           "first-loss difference"], verdicts))
        out.append("")


FULL_DEPTH_PEERS = ("hf_liger", "hf_liger_peft")


def full_depth_section(out, run, conventions=True):
    """bench_full_depth's tables: per workload (LoRA, full fine-tune) and data (a packed length
    profile or uniform rows) each contender's step at full depth, labelled tokens/s, model TFLOP/s,
    peak memory, whether it recomputed layers and why, out-of-memory rows with what they asked for
    against what was free, and workloads whose state does not fit the card. conventions=False: the
    paragraph of shape and method is left to the section above (another model of the same run)."""
    from benchmarks.full_depth import describe_oom, gib

    shape = run["shape"]
    model = run.get("model", "llama2_7b")
    out.append(f"### The user's job at full depth: {model} on one GPU ({shape['layers']} layers, rows of "
               f"{shape['seq']} tokens): LoRA and full fine-tune\n")
    out.append(_run_line(run))
    if conventions:
        method = run.get("conventions", {})
        out.append(f"{shape['parameters'] / 1e9:.2f} B parameters; LoRA: rank {shape.get('lora_rank', 8)}, alpha "
                   f"{shape.get('lora_alpha', 16)} on q/k/v/o/gate/up/down ({shape['lora_parameters'] / 1e6:.1f} M "
                   f"trainable), base frozen in bf16; full fine-tune: bf16 weights, fp32 masters and moments. Every "
                   f"contender steps the one-pass master-weight AdamW kernel. Model TFLOP/s: 6 x weights x tokens + "
                   f"causal attention per example (the JSON's conventions). Timing: {method.get('timing', '')}. Peak = max "
                   f"allocated over one step (weights, optimizer state, gradients, activations).\n")
    else:
        out.append(f"{shape['parameters'] / 1e9:.2f} B parameters, LoRA {shape['lora_parameters'] / 1e6:.1f} M "
                   "trainable; method, FLOPs and peak as in the section above.\n")
    if run.get("fp8_lm_head") == "fp8":
        out.append("The FP8 contenders' LM head + loss run in FP8 too (`--fp8-lm-head fp8`); the bf16 ones' in bf16.\n")
    if run.get("accumulation", 1) > 1:
        out.append(f"A step is {run['accumulation']} forward+backward passes over the step's data (`--accumulation`, "
                   "the Trainer's gradient_accumulation_steps), then one optimizer step; step time, tokens/s and "
                   "TFLOP/s count every pass.\n")
    for workload, result in run["workloads"].items():
        if workload.startswith("full_low_memory"):
            optimizers = {n: r.get("optimizer_name") for n, r in result.get("contenders", {}).items()}
            out.append(f"{workload}: no fp32 masters; each contender's own optimizer ("
                       + ", ".join(f"{n}: {o}" for n, o in optimizers.items()) + ").\n")
        if "contenders" not in result:
            out.append(f"{workload}: " + str(result.get("error", "no results (a run cut short: rounds_so_far)"))[:200]
                       + "\n")
            continue
        contenders, rows = result["contenders"], []
        states = {(r["persistent_state_bytes"], r["device_bytes"]) if r.get("does_not_fit") else None
                  for r in contenders.values()}
        if len(states) == 1 and None not in states:  # every contender too big: one line, not a table
            r = next(iter(contenders.values()))
            out.append(f"{workload}: no contender fits ({', '.join(contenders)}): state "
                       f"{gib(r['persistent_state_bytes'])} > {gib(r['device_bytes'])} (short by "
                       f"{gib(r['short_by_bytes'])}).\n")
            continue
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
                         f"{rate:.0f}", f"{r['model_tflops']:.0f}" + (f" (NeMo's count: {r['nemo_model_tflops']:.0f})"
                                                                      if r.get("nemo_model_tflops") else ""),
                         f"{r['peak_bytes'] / 2**30:.2f}", recompute,
                         _versus(contenders, name, peers) if _is_ours(name) else ""])
        out.append(table(["workload:data", "contender", "step ms (spread)", "fwd+bwd ms", "optimizer ms",
                           "labelled tokens/s", "model TFLOP/s", "peak GiB", "layer recompute", "step vs best peer"],
                          rows))
        out.append("")
        if result.get("first_step_losses"):
            out.append(f"{workload}: first-step losses (same weights and tokens) "
                       + ", ".join(f"{n} {v:.4f}" for n, v in result["first_step_losses"].items())
                       + f"; largest relative difference {result['first_step_loss_max_relative_difference'] or 0:.1e}.\n")


def convergence_section(out, distances, convergence):
    """The runs' loss curves (FP8 recipes, the optimizer's memory modes) against the reference, bf16 on fp32 masters
    and moments: the distances that benchmarks/plot_convergence.py writes (`--summary`) beside the run's own
    command and seconds."""
    out.append("### Convergence against bf16 on fp32 masters and moments (same batches)\n")
    out.append(_run_line(convergence))
    out.append(f"{convergence['model']['parameters'] / 1e6:.0f}M LLaMA, {convergence['setup']['tokens_per_step']} tokens a "
               f"step, {len(convergence['runs'][distances['reference']]['train_loss'])} steps; "
               f"{convergence['setup']['optimizer']}. Distances from `{distances['reference']}` (ratio - 1 of the "
               f"training loss, a moving mean of {distances['train_window']} steps, and of the held-out loss), from "
               f"`python -m benchmarks.plot_convergence {distances['source']} --summary ...`.\n")
    rows = []
    for name, row in distances["distances"].items():
        optimizer = convergence["runs"][name].get("optimizer", "")
        rows.append([name, convergence["setup"].get("optimizers", {}).get(optimizer, optimizer),
                     f"{row['train_mean_abs']:.2%}", f"{row['train_second_half_mean']:+.2%}",
                     f"{row['heldout_mean_abs']:.2%}", f"{row['final_train']:+.2%}", f"{row['final_heldout']:+.2%}",
                     f"{convergence['runs'][name]['seconds']:.0f}"])
    out.append(table(["run", "optimizer state", "train mean abs", "train 2nd half mean", "held-out mean abs",
                      f"final train (last {distances['end_steps']})", "final held-out", "seconds"], rows))
    out.append("")
