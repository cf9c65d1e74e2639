"""Where the FP8 training step's time goes against its targets (forward+backward >= 1.7x HF + Liger bf16,
>= 1.6x with the optimizer step), from committed H100 measurements, and what each candidate change could win.

    python -m benchmarks.fp8_step_budget [--out benchmarks/results/fp8_step_budget.json]

Runs on any machine (json and arithmetic only). Inputs, all committed and from one card kind (H100 80 GB):
- --step (run20/step.json): the timed whole steps (round-robin, median of round medians) of ours FP8 (delayed,
  current) and HF + Liger bf16 at both widths, forward+backward and with the optimizer, each config's shape;
- --profile (run19/profile_step.json): the kernel timeline of one 7B-width step, ours FP8 delayed and HF + Liger
  in one run: GPU time by category, every GEMM kernel by name, the idle time between kernels;
- --ceilings (run20/fp8_ffn.json "ceilings"): the card's measured copy bandwidth and bf16 GEMM TFLOP/s.

What the profile shows is split by what could move it:
- the GEMMs: cuBLASLt's Hopper kernels name their operand types, FP8 ones with a `q`/`r` after `nvjet_sm90_`
  (e4m3 / e5m2: `qq` forward, `qr` dgrad and wgrad); the rest are the 16-bit GEMMs, the LM head's alone in a
  bf16-head FP8 step. The FP8 GEMMs' rate is the projections' FLOPs (the model's less attention's and the LM
  head's) over their time;
- the FP8 cast passes (the quantize, amax and transpose kernels: work the bf16 step does not have), by kernel;
- attention, the fused elementwise ops, the rest, and the idle time (the GPU waiting for the host).
Candidates, each estimated from the profile alone (not measured until a GPU run says so):
- the LM head's three GEMMs in FP8 (`fast_ffn_fp8_lm_head: fp8`): its 16-bit GEMM time less the same FLOPs at
  the FP8 GEMMs' rate, less the extra bytes its casts move at copy bandwidth (d_logits read in bf16 and
  written in FP8 once; h and W are small);
- the weights' amax pass folded into the AdamW kernel, which reads and writes every weight anyway (weights are
  current-scaled under both recipes, so the amax pass is one read of every weight per step);
- the idle time, taken back by less host work per kernel.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS_DIR, write_results
from benchmarks.step_floor import attention_flops

TARGET_FORWARD_BACKWARD = 1.7
TARGET_WITH_OPTIMIZER = 1.6
FP8_GEMM_MARKS = ("nvjet_sm90_qq", "nvjet_sm90_qr", "nvjet_sm90_rq")  # cuBLASLt's FP8-operand GEMM kernels
CAST_KERNEL_MARKS = ("quantize_kernel", "amax_kernel", "fp8_transpose", "transpose_kernel")
WEIGHT_AMAX_MARK = "amax_kernel"  # the standalone amax pass: the weights' (activations' ride in the casts)
PROFILED_CONFIG = "llama2_7b_8layers"
FP8_CONTENDER, PEER = "ours_fp8_delayed", "hf_liger"
RECIPES = ("ours_fp8_delayed", "ours_fp8_current")


def lm_head_flops(shape: dict) -> float:
    """Forward + backward GEMM FLOPs of the LM head (logits, d_hidden, d_weight)."""
    return 6 * shape["tokens"] * shape["hidden"] * shape["vocab"]


def projection_flops(shape: dict) -> float:
    return shape["model_flops_per_step"] - attention_flops(shape) - lm_head_flops(shape)


def kernels(profile_contender: dict) -> list:
    return profile_contender["gpu_only"]["top_kernels"]


def summed(rows: list, marks: tuple) -> dict:
    chosen = [k for k in rows if any(m in k["name"] for m in marks)]
    return {"ms": sum(k["ms_per_step"] for k in chosen), "calls": sum(k["calls_per_step"] for k in chosen)}


def profile_budget(profiled: dict, shape: dict, ceilings: dict) -> dict:
    """The profiled FP8 step's forward+backward, split by what could move it (module doc)."""
    gpu = profiled[FP8_CONTENDER]["gpu_only"]
    categories = dict(gpu["kernel_ms_by_category"])
    optimizer_ms = categories.pop("optimizer", 0.0)
    rows = kernels(profiled[FP8_CONTENDER])
    gemm_rows = [k for k in rows if k["category"] == "gemm"]
    listed_gemm_ms = sum(k["ms_per_step"] for k in gemm_rows)
    # every GEMM kernel must be in the profile's list, or the split below would miss some
    if abs(listed_gemm_ms - categories["gemm"]) > 0.01 * categories["gemm"]:
        raise ValueError(f"the profile lists {listed_gemm_ms:.2f} ms of GEMM kernels of {categories['gemm']:.2f}: "
                         "rerun profile_step with a longer kernel list")
    fp8_gemm = summed(gemm_rows, FP8_GEMM_MARKS)
    half_gemm_ms = categories["gemm"] - fp8_gemm["ms"]
    casts = [k for k in rows if any(m in k["name"] for m in CAST_KERNEL_MARKS)]
    fp8_rate = projection_flops(shape) / (fp8_gemm["ms"] * 1e-3) / 1e12
    return {
        "forward_backward_span_ms": gpu["span_ms"] - optimizer_ms,
        "peer_forward_backward_span_ms": profiled[PEER]["gpu_only"]["span_ms"]
        - profiled[PEER]["gpu_only"]["kernel_ms_by_category"].get("optimizer", 0.0),
        "idle_ms": gpu["idle_ms"],
        "kernel_ms_by_category": categories,
        "fp8_gemm_ms": fp8_gemm["ms"], "fp8_gemm_calls": fp8_gemm["calls"],
        "fp8_gemm_tflops": fp8_rate,
        "sixteen_bit_gemm_ms": half_gemm_ms,
        "sixteen_bit_gemm_tflops": lm_head_flops(shape) / (half_gemm_ms * 1e-3) / 1e12 if half_gemm_ms > 0 else None,
        "bf16_gemm_ceiling_tflops": ceilings["bf16_gemm_tflops"],
        "cast_kernels": [{"name": k["name"], "ms_per_step": k["ms_per_step"], "calls_per_step": k["calls_per_step"]}
                         for k in casts],
        "cast_ms": sum(k["ms_per_step"] for k in casts),
        "weight_amax_ms": summed(casts, (WEIGHT_AMAX_MARK,))["ms"],
    }


def candidates(budget: dict, shape: dict, ceilings: dict) -> dict:
    """Each candidate's estimated saving on the profiled step's forward+backward (module doc)."""
    head_fp8_ms = lm_head_flops(shape) / (budget["fp8_gemm_tflops"] * 1e12) * 1e3
    d_logits_bytes = shape["tokens"] * shape["vocab"] * (2 + 1)  # bf16 read, FP8 write, once
    head_cast_ms = d_logits_bytes / ceilings["copy_bytes_per_s"] * 1e3
    return {
        "fp8_lm_head": max(0.0, budget["sixteen_bit_gemm_ms"] - head_fp8_ms - head_cast_ms),
        "weight_amax_in_adamw": budget["weight_amax_ms"],
        "no_idle": budget["idle_ms"],
    }


def target_rows(step: dict) -> list:
    rows = []
    for name, config in step["step"].items():
        peer = {part: config[PEER][part]["p50_ms"] for part in ("forward_backward", "step")}
        for recipe in RECIPES:
            ours = {part: config[recipe][part]["p50_ms"] for part in ("forward_backward", "step")}
            fb_needed = peer["forward_backward"] / TARGET_FORWARD_BACKWARD
            step_needed = peer["step"] / TARGET_WITH_OPTIMIZER
            rows.append({
                "config": name, "recipe": recipe,
                "forward_backward_ms": ours["forward_backward"], "peer_forward_backward_ms": peer["forward_backward"],
                "forward_backward_ratio": peer["forward_backward"] / ours["forward_backward"],
                "forward_backward_needed_ms": fb_needed,
                "forward_backward_short_by_ms": max(0.0, ours["forward_backward"] - fb_needed),
                "step_ms": ours["step"], "peer_step_ms": peer["step"], "step_ratio": peer["step"] / ours["step"],
                "step_needed_ms": step_needed, "step_short_by_ms": max(0.0, ours["step"] - step_needed),
            })
    return rows


def in_repo(path: Path) -> str:
    """path relative to the repository where it lies inside it (committed inputs), else as given."""
    root = RESULTS_DIR.parent.parent.resolve()
    resolved = path.resolve()
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(path)


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", type=Path, default=RESULTS_DIR / "run20" / "step.json")
    parser.add_argument("--profile", type=Path, default=RESULTS_DIR / "run19" / "profile_step.json")
    parser.add_argument("--ceilings", type=Path, default=RESULTS_DIR / "run20" / "fp8_ffn.json")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "fp8_step_budget.json")
    args = parser.parse_args(argv)
    step = json.loads(args.step.read_text())
    profile = json.loads(args.profile.read_text())
    ceilings = json.loads(args.ceilings.read_text())["ceilings"]
    devices = {step["environment"]["device"], profile["environment"]["device"]}
    if len(devices) != 1:
        raise ValueError(f"the step and the profile come from different cards: {sorted(devices)}")

    shape = step["step"][PROFILED_CONFIG]["shape"]
    budget = profile_budget(profile[PROFILED_CONFIG], shape, ceilings)
    savings = candidates(budget, shape, ceilings)
    targets = target_rows(step)
    profiled_row = next(r for r in targets if r["config"] == PROFILED_CONFIG and r["recipe"] == FP8_CONTENDER)
    estimated_ms = profiled_row["forward_backward_ms"] - sum(savings.values())
    payload = {
        "what": __doc__.split("\n\n")[0].strip(),
        "inputs": {"step": in_repo(args.step), "profile": in_repo(args.profile), "ceilings": in_repo(args.ceilings),
                   "device": devices.pop(), "ceilings_used": ceilings},
        "targets": targets,
        "profiled_step_7b": budget,
        "estimated_savings_ms": savings,
        "with_every_candidate_7b": {
            "forward_backward_ms": estimated_ms,
            "ratio": profiled_row["peer_forward_backward_ms"] / estimated_ms,
            "target": TARGET_FORWARD_BACKWARD,
        },
    }
    path = write_results(args.out.stem, payload, args.out.parent)
    for row in targets:
        print(f"{row['config']} {row['recipe']}: forward+backward {row['forward_backward_ratio']:.3f}x "
              f"({row['forward_backward_ms']:.1f} ms; {TARGET_FORWARD_BACKWARD}x needs {row['forward_backward_needed_ms']:.1f}), "
              f"with the optimizer {row['step_ratio']:.3f}x ({row['step_ms']:.1f} ms; {TARGET_WITH_OPTIMIZER}x needs "
              f"{row['step_needed_ms']:.1f})")
    b = budget
    print(f"profiled 7B FP8 step, forward+backward {b['forward_backward_span_ms']:.1f} ms: FP8 GEMMs "
          f"{b['fp8_gemm_ms']:.1f} ms at {b['fp8_gemm_tflops']:.0f} TFLOP/s, 16-bit GEMMs (LM head) "
          f"{b['sixteen_bit_gemm_ms']:.1f} ms, attention {b['kernel_ms_by_category'].get('attention', 0):.1f}, FP8 casts "
          f"{b['cast_ms']:.1f} (weight amax {b['weight_amax_ms']:.1f}), idle {b['idle_ms']:.1f}")
    print("estimated savings (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in savings.items())
          + f" -> {estimated_ms:.1f} ms, {payload['with_every_candidate_7b']['ratio']:.3f}x")
    return path


if __name__ == "__main__":
    main()
