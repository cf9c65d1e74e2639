"""A full-depth LLaMA-2-7B (32 layers, vocab 32000) training step on one H200, 4096-token rows
(batch 1 x seq 4096), two workloads (benchmarks/full_depth.py holds the plan, the FLOP counts and
the out-of-memory report, tested without torch):

    python3 -m benchmarks.gpu.bench_full_depth --out full_depth.json [--workloads lora,full]

lora  LoRA rank 8, alpha 16, on q/k/v/o/gate/up/down, every base weight frozen in bf16.
      ours: FastLlama(lora=) running LLAMA_DECODER_LAYER_UNFUSED, what the Paddle path runs under
      PaddleNLP's LoRAModel (unfuse_for_lora: unfused q/k/v and gate/up, each a LoRALinear, the
      two-input SwiGLU, a LoRA down_proj); ours_fp8_delayed: the same with each projection's frozen
      base GEMM in FP8 (delayed scaling; Paddle's attach_fp8 gives each LoRALinear an Fp8Linear),
      adapters in bf16. hf_liger_peft: Hugging Face's LlamaForCausalLM patched by Liger, adapters
      placed by PEFT's get_peft_model (LoraConfig r=8, lora_alpha=16, no dropout; adapters kept in
      bf16, autocast_adapter_dtype=False, as ours are).
full  full fine-tune: ours and ours_fp8_delayed (FastLlama, the fused list and the FP8 list) against
      hf_liger.
Every contender steps the one-pass master-weight AdamW kernel (llama_model.FusedMasterAdamW: fp32
masters and moments of the trainable parameters), lr 1e-5, weight decay 0.01, no clipping.

Weights: random, Hugging Face's initialisation (LlamaForCausalLM(config) after torch.manual_seed(0),
the same weights for every contender; ours copies them). Tokens: random ids, labels = the ids
shifted (Hugging Face shifts inside its loss; ours gets them shifted, as PaddleNLP's pipeline
hands them), so the first step's loss must agree across contenders (reported).

Two 7B contenders with optimizer state do not fit side by side, so the step is timed round-robin
over rebuilt contenders (bench_gpu.round_robin_rebuilt): each round builds, warms up (2 steps),
times (5 steps, CUDA events) and frees every contender once, in an order rotated by one per round,
3 rounds; each figure is the median over rounds of each round's median (spread over rounds). Peak
memory: torch.cuda.max_memory_allocated over one more step after reset_peak_memory_stats (weights,
optimizer state, gradients and activations). A configuration that runs out of memory reports what
it asked for against what was free; where memory needs it, a contender is rebuilt with full
recompute per decoder layer (Hugging Face's gradient checkpointing; FastLlama(layer_recompute=True)
for ours in bf16) and the row says so and why.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import sys
import time
import traceback

import torch

from benchmarks import full_depth as plan
from benchmarks.common import MIN_REPEATS
from benchmarks.gpu.bench_gpu import environment, liger_patched, round_robin_rebuilt
from benchmarks.gpu.bench_step import fused_master_adamw, hf_config, measure_training, new_hf_model


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def random_batch(shape, device="cuda"):
    """Random ids (seeded apart from the weights) and their shifted labels."""
    from benchmarks.gpu.llama_model import shift_labels

    generator = torch.Generator(device=device).manual_seed(1234)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device, generator=generator)
    return ids, shift_labels(ids)


def seeded_hf_model(config):
    """Hugging Face's LlamaForCausalLM with its own initialisation, the same weights every call."""
    torch.manual_seed(0)
    return new_hf_model(config)


def builders(workload, shape, ids, labels):
    """{contender: build(recompute) -> (model, forward() -> loss, context manager factory)}; the
    model's trainable parameters are what the optimizer steps."""
    from benchmarks.gpu.fp8_ffn import Fp8Recipe
    from benchmarks.gpu.llama_model import FastLlama, LoraSettings

    config = hf_config(shape)
    lora = LoraSettings(rank=plan.LORA_RANK, alpha=plan.LORA_ALPHA) if workload == "lora" else None

    def ours(fp8_kind=None):
        def build(recompute):
            hf = seeded_hf_model(config)
            recipe = None if fp8_kind is None else Fp8Recipe(kind=fp8_kind)
            model = FastLlama(hf, fp8_recipe=recipe, lora=lora, layer_recompute=recompute)
            del hf  # ours holds its own copies
            return model, lambda: model(ids, labels)
        return build, contextlib.nullcontext

    def hf_liger(build_peft):
        def build(recompute):
            model = seeded_hf_model(config)
            if recompute:
                model.config.use_cache = False
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if build_peft:
                from peft import LoraConfig, get_peft_model

                peft_config = LoraConfig(r=plan.LORA_RANK, lora_alpha=plan.LORA_ALPHA, lora_dropout=0.0,
                                         target_modules=list(plan.LORA_TARGETS), bias="none", task_type="CAUSAL_LM")
                model = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
            return model, lambda: model(input_ids=ids, labels=ids).loss
        return build, lambda: liger_patched(fused_linear_cross_entropy=True)

    table = {"ours": ours(), "ours_fp8_delayed": ours("delayed"), "hf_liger": hf_liger(False),
             "hf_liger_peft": hf_liger(True)}
    return {name: table[name] for name in plan.WORKLOADS[workload]}


def can_recompute(contender: str) -> bool:
    """Full recompute per layer where it exists: Hugging Face's gradient checkpointing, and ours in
    bf16 (FastLlama refuses it with FP8: the scaling states would see the forward twice)."""
    return "fp8" not in contender


def run_once(build, context, recompute, steps, warmup):
    """Build, measure and free one contender: bench_step.measure_training's row, or an OOM report."""
    torch.cuda.reset_peak_memory_stats()
    phase = "build"
    try:
        with context():
            model, forward = build(recompute)
            phase = "step"
            row = measure_training(forward, model, fused_master_adamw, steps=steps, warmup=warmup)
        row["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        return row
    except torch.OutOfMemoryError as error:
        message = str(error)
    # outside the except block: the traceback (and the frames holding the model) are gone
    model = forward = None
    allocated, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    gc.collect()
    torch.cuda.empty_cache()
    return plan.oom_report(message, phase, allocated, peak)


def measure_workload(workload, shape, ids, labels, rounds, steps, warmup, save, stop_at, log, not_run=None):
    """round_robin_rebuilt over the workload's contenders but those in not_run ({contender: why},
    whose rows say why). Each contender first runs without layer recompute; an OOM there is
    recorded and, where the contender can, it is rebuilt with full recompute per layer for this and
    every later round. A contender that does not fit at all keeps its OOM row (not rebuilt in later
    rounds)."""
    not_run = not_run or {}
    contenders = {n: b for n, b in builders(workload, shape, ids, labels).items() if n not in not_run}
    decided = {}  # contender -> {"recompute": bool, "oom_without_recompute": row} or {"oom": row}
    progress = []

    def measured(name, build, context):
        def run():
            if time.time() > stop_at:
                raise TimeoutError(f"skipped (time budget, --stop-after-s) at {time.time() - started:.0f} s")
            if "oom" in decided.get(name, {}):
                return {**decided[name]["oom"], "note": "not rebuilt: it ran out of memory in an earlier round"}
            choice = decided.setdefault(name, {"recompute": False})
            row = run_once(build, context, choice["recompute"], steps, warmup)
            if row.get("oom") and not choice["recompute"] and can_recompute(name):
                log(f"{workload} {name}: {plan.describe_oom(row)}; rebuilding with full recompute per layer")
                choice.update(recompute=True, oom_without_recompute=row)
                row = run_once(build, context, True, steps, warmup)
            row["layer_recompute"] = choice["recompute"]
            if row.get("oom"):  # with recompute, or where there is none: it does not fit
                decided[name] = {"oom": row}
                return row
            if choice["recompute"]:
                row["recompute_because"] = plan.describe_oom(choice["oom_without_recompute"])
            return row
        return run

    def on_round(name, index, row):
        summary = (plan.describe_oom(row) if row.get("oom") else row.get("error") or
                   f"step {row.get('step_ms', 0):.1f} ms (fwd+bwd {row.get('forward_backward_ms', 0):.1f}, optimizer "
                   f"{row.get('optimizer_ms', 0):.1f}), peak {plan.gib(row.get('peak_bytes'))}")
        log(f"{workload} {name} round {index}: {summary}")
        progress.append({"contender": name, "round": index, **{k: v for k, v in row.items() if k != "trace"}})
        save(progress)

    started = time.time()
    runs = {name: measured(name, build, context) for name, (build, context) in contenders.items()}
    results = round_robin_rebuilt(runs, rounds, on_round)
    tokens = shape["batch"] * shape["seq"]
    flops = plan.model_flops(**shape)
    executed = plan.lora_executed_flops(**shape) if workload == "lora" else flops
    results.update({name: {"error": why} for name, why in not_run.items() if name in plan.WORKLOADS[workload]})
    for row in results.values():
        if isinstance(row.get("step"), dict):
            row.update({k: row["step"][k] for k in ("p50_ms", "p20_ms", "p80_ms", "spread_ms", "repeats")})
            seconds = row["p50_ms"] * 1e-3
            row.update(tokens_per_s=tokens / seconds, model_tflops=flops / seconds / 1e12,
                       executed_tflops=executed / seconds / 1e12)
    first = {n: r["first_losses"][0] for n, r in results.items() if r.get("first_losses")}
    return {"contenders": results, "first_step_losses": first,
            "first_step_loss_max_relative_difference":
                (max(first.values()) - min(first.values())) / abs(min(first.values())) if len(first) > 1 else None,
            "model_flops_per_step": flops, "executed_flops_per_step": executed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--rounds", type=int, default=MIN_REPEATS, help="round-robin rounds (at least 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contender and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--layers", type=int, default=plan.LLAMA2_7B["layers"],
                        help="decoder layers (32: LLaMA-2-7B; fewer only to try the script)")
    parser.add_argument("--stop-after-s", type=float, default=None,
                        help="start no contender round after this many seconds (device-time budget)")
    parser.add_argument("--allow-missing-peers", action="store_true",
                        help="run without a peer whose packages are missing (its rows say so) instead of stopping")
    args = parser.parse_args()
    workloads = plan.workloads_from(args.workloads)
    if args.steps < 3 or args.warmup < 1:
        parser.error("--steps must be at least 3 and --warmup at least 1")

    missing = plan.missing_packages(workloads, importable)
    for contender, names in missing.items():
        print(f"MISSING for {contender}: {', '.join(names)} (carry their wheels in .whl: see run_on_h200.sh)")
    not_run = {contender: f"not run: cannot be imported here (missing {', '.join(names)})"
               for contender, names in missing.items()}
    if "lora" in workloads and "hf_liger_peft" not in not_run:
        try:  # present is not enough: peft must import against this transformers
            import peft
            print(f"peft {peft.__version__} imports")
        except Exception as error:  # noqa: BLE001
            not_run["hf_liger_peft"] = f"not run: import peft failed here: {error!r}"[:400]
            print(not_run["hf_liger_peft"])
    if not_run and not args.allow_missing_peers:
        print("stopping: a peer cannot be imported (--allow-missing-peers runs without it, its rows saying so)")
        sys.exit(2)

    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.time()
    stop_at = started + args.stop_after_s if args.stop_after_s else float("inf")
    shape = {**plan.LLAMA2_7B, "layers": args.layers}
    report = {"environment": environment(),
              "command": "python3 -m benchmarks.gpu.bench_full_depth " + " ".join(sys.argv[1:]),
              "shape": {**shape, "tokens": shape["batch"] * shape["seq"], "parameters": plan.parameter_count(**shape),
                        "lora_parameters": plan.lora_parameter_count(**shape), "lora_rank": plan.LORA_RANK,
                        "lora_alpha": plan.LORA_ALPHA, "lora_targets": list(plan.LORA_TARGETS)},
              "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
              "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
              "persistent_state_bytes": {w: plan.persistent_state_bytes(w, **shape) for w in workloads},
              "packages": {name: importable(name) for name in ("peft", "accelerate", "liger_kernel")},
              "conventions": {
                  "model_tflops": "bench_step's model FLOPs (6 x GEMM weights incl. LM head x tokens + causal "
                                  "attention at half, 3x forward) for both workloads; LoRA rows quote the same "
                                  "model FLOPs",
                  "executed_tflops": "LoRA: the GEMM work a LoRA step does (frozen GEMMs forward + input gradient, "
                                     "attention, adapters 3x); full fine-tune: equal to model_tflops",
                  "peak_bytes": "torch.cuda.max_memory_allocated over one step after reset_peak_memory_stats: weights, "
                                "optimizer state, gradients, activations",
                  "optimizer": "llama_model.FusedMasterAdamW for every contender (fp32 masters and moments of the "
                               "trainable parameters), lr 1e-5, weight decay 0.01, no clipping",
                  "timing": f"round-robin over rebuilt contenders, {max(args.rounds, MIN_REPEATS)} rounds of "
                            f"{args.warmup} warm-up + {args.steps} timed steps; median of round medians (spread)"},
              "workloads": {}}
    report["not_run"] = not_run

    def save(progress=None, workload=None):
        if progress is not None:
            report["workloads"].setdefault(workload, {})["rounds_so_far"] = progress
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)

    def log(line):
        print(f"[{time.time() - started:4.0f}s] {line}", flush=True)

    ids, labels = random_batch(shape)
    for workload in workloads:
        try:
            result = measure_workload(workload, shape, ids, labels, args.rounds, args.steps, args.warmup,
                                      lambda progress, w=workload: save(progress, w), stop_at, log, not_run)
            report["workloads"][workload] = result
        except Exception as error:  # noqa: BLE001
            report["workloads"][workload] = {"error": repr(error), "trace": traceback.format_exc()[-2500:]}
            log(f"{workload} failed: {error!r}")
        save()
        gc.collect()
        torch.cuda.empty_cache()
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
