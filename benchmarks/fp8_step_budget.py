"""Where the FP8 training step's time goes against its targets (forward+backward >= 1.7x HF + Liger bf16,
>= 1.6x with the optimizer step), from committed H100 measurements, and what each change could still win.

    python -m benchmarks.fp8_step_budget [--out benchmarks/results/fp8_step_budget.json]

Runs on any machine (json and arithmetic only). Inputs, all committed and from one card kind (H100 80 GB):
- --step (run21/step.json): the timed whole steps (round-robin, median of round medians) of ours FP8 (delayed,
  current, delayed with the LM head in FP8) and HF + Liger bf16 at both widths, forward+backward and with the
  optimizer, each config's shape;
- --profile (run21/profile_step.json): the kernel timeline of one 7B-width step of ours FP8 delayed with the LM
  head in bf16 and in FP8, and HF + Liger, in one run: GPU time by category, every GEMM and cast kernel by name,
  the idle time between kernels;
- --ceilings (run20/fp8_ffn.json "ceilings"): the card's measured copy bandwidth and bf16 GEMM TFLOP/s.

What each profiled FP8 step shows is split by what could move it:
- the GEMMs: cuBLASLt's Hopper kernels name their operand types, FP8 ones with a `q`/`r` after `nvjet_sm90_`
  (e4m3 / e5m2: `qq` forward, `qr`/`rq` dgrad and wgrad); the rest are 16-bit GEMMs, the LM head's alone in a
  bf16-head FP8 step. The FP8 GEMMs' rate is their FLOPs (the projections', and the LM head's where it is FP8)
  over their time;
- the FP8 cast passes (quantize, amax and transpose kernels: work the bf16 step does not have), per kernel with
  the calls and bytes the step's data flow gives it (`cast_model`, its calls checked against the profile's) and
  their rate against the measured copy bandwidth;
- attention, the fused elementwise ops, the rest, and the idle time (the GPU waiting for the host).
What is left to win, on the fastest profiled contender (estimates from the profile, not measurements):
- the cast passes whose tensor another kernel already reads or writes (the activations' e4m3 casts after the
  norms and attention, the output gradients' e5m2 casts after the norms' and rotary's backward): at most their
  whole time, if the producer wrote FP8 in its epilogue;
- the weights' casts (the forward copy and, per use, backward's transposed copy): at most their whole time;
- the idle time, taken back by less host work per kernel.
The FP8 LM head's casts are not counted: in the profiled code (run 21) each was current-scaled per chunk, so its
amax pass had to come first.
Each lever alone and every combination of them is reported, against the 1.7x target.
And the earlier estimate against its measurement: the LM head in FP8, estimated from the bf16-head contender's
profile (its 16-bit GEMM time less the same FLOPs at the FP8 rate and its casts' bytes), measured as the two
contenders' forward+backward difference in the same step run (median, and per round) and in the profile.
The cast kernels' rates are the model's bytes over the copy bandwidth of --ceilings, measured on another H100 than
run 21's (whose bf16 GEMMs ran 5% above that run's ceiling): read a 90-95% rate as "near the copy", not exactly.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from benchmarks.common import RESULTS_DIR, write_results
from benchmarks.step_floor import attention_flops

TARGET_FORWARD_BACKWARD = 1.7
TARGET_WITH_OPTIMIZER = 1.6
FP8_GEMM_MARKS = ("nvjet_sm90_qq", "nvjet_sm90_qr", "nvjet_sm90_rq")  # cuBLASLt's FP8-operand GEMM kernels
CAST_KERNEL_MARKS = ("quantize_kernel", "amax_kernel", "fp8_transpose", "transpose_kernel")
PROFILED_CONFIG = "llama2_7b_8layers"
# The profiled FP8 contenders and where each runs its LM head's GEMMs; the last is the fastest.
PROFILED = {"ours_fp8_delayed": "bf16", "ours_fp8_delayed_fp8_head": "fp8"}
BF16_HEAD, FP8_HEAD = PROFILED
PEER = "hf_liger"
RECIPES = ("ours_fp8_delayed", "ours_fp8_current", "ours_fp8_delayed_fp8_head")
# fastffn's quantize_kernel<T, format, transposed> by its template arguments, as the profile names them
CAST_KINDS = {"weights_forward_copy": "quantize_kernel<__nv_bfloat16, (__nv_fp8_interpretation_t)0, false>",
              "e4m3_with_transposed_copy": "quantize_kernel<__nv_bfloat16, (__nv_fp8_interpretation_t)0, true>",
              "e5m2_with_transposed_copy": "quantize_kernel<__nv_bfloat16, (__nv_fp8_interpretation_t)1, true>",
              "amax": "amax_kernel<__nv_bfloat16>"}


def lm_head_flops(shape: dict) -> float:
    """Forward + backward GEMM FLOPs of the LM head (logits, d_hidden, d_weight)."""
    return 6 * shape["tokens"] * shape["hidden"] * shape["vocab"]


def projection_flops(shape: dict) -> float:
    return shape["model_flops_per_step"] - attention_flops(shape) - lm_head_flops(shape)


def cast_model(shape: dict, head: str) -> dict:
    """The cast kernels' calls and bytes in one forward+backward, from the data flow of core/fp8/linear.py, ffn.py
    and lm_head.py with per-use weight copies (the default) over torch's [out, in] weights, bf16 in, one FP8 byte
    out per copy: {kind: {part: (calls, bytes)}}. Per layer: the forward copy of the four projections' weights (read
    2, write 1); backward's transposed copy of each (read 2, write 1); the inputs of qkv, o_proj and gate_up with
    their transposed copies (read 2, write 1 + 1); the output gradients of o_proj, qkv and the FFN likewise in e5m2
    (gate_up's comes out of the SwiGLU backward kernel). An FP8 head adds h and W (both copies) and d_logits (both
    copies, one chunk at these shapes), each current-scaled in the profiled code (run 21): an amax pass over each
    first. L2 hits are not modelled
    (a weight of under 50 MB quantised twice in a row may be read from L2 the second time)."""
    t, h, i, v, layers = shape["tokens"], shape["hidden"], shape["inter"], shape["vocab"], shape["layers"]
    qkv = h + 2 * h * shape["kv_heads"] // shape["heads"]
    weights = layers * (qkv * h + h * h + 2 * i * h + i * h)
    kinds = {
        "weights_forward_copy": {"weights": (4 * layers, 3 * weights)},
        "e4m3_with_transposed_copy": {"weights_dgrad_copy": (4 * layers, 3 * weights),
                                      "activations": (3 * layers, layers * 3 * 4 * t * h)},
        "e5m2_with_transposed_copy": {"output_gradients": (3 * layers, layers * 4 * t * (h + qkv + h))},
        "amax": {},
    }
    if head == "fp8":
        kinds["e4m3_with_transposed_copy"]["lm_head"] = (2, 4 * t * h + 4 * v * h)
        kinds["e5m2_with_transposed_copy"]["lm_head"] = (1, 4 * t * v)
        kinds["amax"]["lm_head"] = (3, 2 * (t * h + v * h + t * v))
    return kinds


def summed(rows: list, marks: tuple) -> dict:
    chosen = [k for k in rows if any(m in k["name"] for m in marks)]
    return {"ms": sum(k["ms_per_step"] for k in chosen), "calls": sum(k["calls_per_step"] for k in chosen)}


def cast_rows(rows: list, shape: dict, head: str, copy_bytes_per_s: float) -> dict:
    """Per cast kind: the profile's calls and time, the model's calls and bytes by part, and their rate. A kind
    whose profiled calls differ from the model's is refused: the model would not describe that step."""
    out = {}
    for kind, parts in cast_model(shape, head).items():
        found = [k for k in rows if CAST_KINDS[kind] in k["name"]]
        calls = sum(k["calls_per_step"] for k in found)
        modelled = sum(c for c, _ in parts.values())
        if calls != modelled:
            raise ValueError(f"the profile has {calls:g} {kind} calls a step where the cast model has {modelled}: "
                             "the model does not describe this step")
        if not found:
            continue
        ms, total = sum(k["ms_per_step"] for k in found), sum(b for _, b in parts.values())
        out[kind] = {"calls_per_step": calls, "ms": ms, "bytes": {part: b for part, (_, b) in parts.items()},
                     "fraction_of_copy": total / (ms * 1e-3) / copy_bytes_per_s}
    return out


def profile_budget(profiled: dict, name: str, shape: dict, ceilings: dict) -> dict:
    """One profiled FP8 step's forward+backward, split by what could move it (module doc)."""
    head = PROFILED[name]
    gpu = profiled[name]["gpu_only"]
    categories = dict(gpu["kernel_ms_by_category"])
    optimizer_ms = categories.pop("optimizer", 0.0)
    rows = profiled[name]["gpu_only"]["top_kernels"]
    gemm_rows = [k for k in rows if k["category"] == "gemm"]
    listed_gemm_ms = sum(k["ms_per_step"] for k in gemm_rows)
    # every GEMM kernel must be in the profile's list, or the split below would miss some
    if abs(listed_gemm_ms - categories["gemm"]) > 0.01 * categories["gemm"]:
        raise ValueError(f"the profile lists {listed_gemm_ms:.2f} ms of GEMM kernels of {categories['gemm']:.2f}: "
                         "rerun profile_step with a longer kernel list")
    fp8_gemm = summed(gemm_rows, FP8_GEMM_MARKS)
    half_gemm_ms = categories["gemm"] - fp8_gemm["ms"]
    fp8_flops = projection_flops(shape) + (lm_head_flops(shape) if head == "fp8" else 0.0)
    casts = [k for k in rows if any(m in k["name"] for m in CAST_KERNEL_MARKS)]
    return {
        "lm_head": head,
        "forward_backward_span_ms": gpu["span_ms"] - optimizer_ms,
        "idle_ms": gpu["idle_ms"],
        "kernel_ms_by_category": categories,
        "fp8_gemm_ms": fp8_gemm["ms"], "fp8_gemm_calls": fp8_gemm["calls"],
        "fp8_gemm_tflops": fp8_flops / (fp8_gemm["ms"] * 1e-3) / 1e12,
        "sixteen_bit_gemm_ms": half_gemm_ms,
        "sixteen_bit_gemm_tflops": (lm_head_flops(shape) / (half_gemm_ms * 1e-3) / 1e12
                                    if head == "bf16" and half_gemm_ms > 0 else None),
        "cast_ms": sum(k["ms_per_step"] for k in casts),
        "casts": cast_rows(rows, shape, head, ceilings["copy_bytes_per_s"]),
    }


def fp8_head_estimate(budget: dict, shape: dict, ceilings: dict) -> float:
    """The LM head's GEMMs in FP8, estimated from a bf16-head profile: its 16-bit GEMM time less the same FLOPs at
    the FP8 GEMMs' rate, less the head's casts and amax passes (cast_model) at copy bandwidth."""
    head_fp8_ms = lm_head_flops(shape) / (budget["fp8_gemm_tflops"] * 1e12) * 1e3
    head_cast_bytes = sum(parts["lm_head"][1] for parts in cast_model(shape, "fp8").values() if "lm_head" in parts)
    return max(0.0, budget["sixteen_bit_gemm_ms"] - head_fp8_ms - head_cast_bytes / ceilings["copy_bytes_per_s"] * 1e3)


def left_to_win(budget: dict) -> dict:
    """Upper bounds on what the fastest contender could still save (module doc), each the profile's time of the
    passes it would remove; a kernel's time is split between its parts (weights, activations, the LM head's) by
    their bytes."""
    casts = budget["casts"]

    def part_ms(kind: str, part: str) -> float:
        cast = casts[kind]
        return cast["ms"] * cast["bytes"][part] / sum(cast["bytes"].values())

    return {
        "activation_and_gradient_casts_into_their_producers": part_ms("e4m3_with_transposed_copy", "activations")
        + part_ms("e5m2_with_transposed_copy", "output_gradients"),
        "weight_casts": part_ms("weights_forward_copy", "weights") + part_ms("e4m3_with_transposed_copy",
                                                                              "weights_dgrad_copy"),
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
    parser.add_argument("--step", type=Path, default=RESULTS_DIR / "run21" / "step.json")
    parser.add_argument("--profile", type=Path, default=RESULTS_DIR / "run21" / "profile_step.json")
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
    budgets = {name: profile_budget(profile[PROFILED_CONFIG], name, shape, ceilings) for name in PROFILED}
    targets = target_rows(step)
    rows = {(r["config"], r["recipe"]): r for r in targets}
    timed = {name: rows[(PROFILED_CONFIG, name)]["forward_backward_ms"] for name in PROFILED}
    left = left_to_win(budgets[FP8_HEAD])
    estimated_ms = timed[FP8_HEAD] - sum(left.values())
    peer_ms = rows[(PROFILED_CONFIG, FP8_HEAD)]["peer_forward_backward_ms"]
    combinations = [{"levers": list(levers), "forward_backward_ms": timed[FP8_HEAD] - sum(left[k] for k in levers),
                     "ratio": peer_ms / (timed[FP8_HEAD] - sum(left[k] for k in levers))}
                    for n in range(1, len(left) + 1) for levers in itertools.combinations(left, n)]
    rounds = {name: [r["forward_backward_ms"] for r in step["step"][PROFILED_CONFIG][name]["rounds"]]
              for name in PROFILED}
    payload = {
        "what": __doc__.split("\n\n")[0].strip(),
        "inputs": {"step": in_repo(args.step), "profile": in_repo(args.profile), "ceilings": in_repo(args.ceilings),
                   "device": devices.pop(), "ceilings_used": ceilings},
        "targets": targets,
        "profiled_steps_7b": budgets,
        "fp8_lm_head_7b": {"estimated_ms": fp8_head_estimate(budgets[BF16_HEAD], shape, ceilings),
                           "measured_ms": timed[BF16_HEAD] - timed[FP8_HEAD],
                           "measured_per_round_ms": [a - b for a, b in zip(rounds[BF16_HEAD], rounds[FP8_HEAD])],
                           "profiled_span_difference_ms": budgets[BF16_HEAD]["forward_backward_span_ms"]
                           - budgets[FP8_HEAD]["forward_backward_span_ms"]},
        "left_to_win_ms": left,
        "left_to_win_combinations_7b": combinations,
        "with_all_of_it_7b": {"forward_backward_ms": estimated_ms, "ratio": peer_ms / estimated_ms,
                              "target": TARGET_FORWARD_BACKWARD},
    }
    path = write_results(args.out.stem, payload, args.out.parent)
    for row in targets:
        print(f"{row['config']} {row['recipe']}: forward+backward {row['forward_backward_ratio']:.3f}x "
              f"({row['forward_backward_ms']:.1f} ms; {TARGET_FORWARD_BACKWARD}x needs {row['forward_backward_needed_ms']:.1f}), "
              f"with the optimizer {row['step_ratio']:.3f}x ({row['step_ms']:.1f} ms; {TARGET_WITH_OPTIMIZER}x needs "
              f"{row['step_needed_ms']:.1f})")
    for name, b in budgets.items():
        print(f"profiled 7B {name}, forward+backward {b['forward_backward_span_ms']:.1f} ms: FP8 GEMMs "
              f"{b['fp8_gemm_ms']:.1f} ms at {b['fp8_gemm_tflops']:.0f} TFLOP/s, 16-bit GEMMs {b['sixteen_bit_gemm_ms']:.1f}, "
              f"attention {b['kernel_ms_by_category'].get('attention', 0):.1f}, FP8 casts {b['cast_ms']:.1f}, "
              f"idle {b['idle_ms']:.1f}")
        for kind, c in b["casts"].items():
            rate = "" if c["fraction_of_copy"] is None else f", {c['fraction_of_copy']:.0%} of copy bandwidth"
            print(f"  {kind}: {c['calls_per_step']:.0f} calls, {c['ms']:.2f} ms{rate}")
    head = payload["fp8_lm_head_7b"]
    print(f"LM head in FP8: estimated {head['estimated_ms']:.1f} ms; timed {head['measured_ms']:.1f} ms (rounds "
          + ", ".join(f"{d:.1f}" for d in head["measured_per_round_ms"])
          + f"); the profiled spans differ by {head['profiled_span_difference_ms']:.1f} ms")
    for row in combinations:
        print(f"  {' + '.join(row['levers'])}: {row['forward_backward_ms']:.1f} ms, {row['ratio']:.3f}x")
    print("left to win (ms, upper bounds): " + ", ".join(f"{k} {v:.1f}" for k, v in left.items())
          + f" -> {estimated_ms:.1f} ms, {payload['with_all_of_it_7b']['ratio']:.3f}x")
    return path


if __name__ == "__main__":
    main()
