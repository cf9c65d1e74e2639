"""Where a whole training step's time goes on the GPU: a kernel timeline of bench_step's step for
ours and its peers, so that the gap between them can be attributed before anything is changed:

    python3 -m benchmarks.gpu.profile_step --out profile_step.json [--configs llama2_7b_8layers]
        [--contenders ours hf_liger]

Per contender, over `--steps` profiled steps (after bench_step's warm-up), per step: the span from
the first kernel to the last, the time some kernel (or memcpy/memset) was running, the idle time
between them (the GPU waiting for the host), that kernel time by category (the decoder bench's
categories plus the optimizer's and the loss's kernels), the largest kernels by name and the
largest idle gaps with the kernels on either side. Two profiles each: the GPU alone ("gpu_only")
and with the host's operators ("with_host": which operator launched the work that ended each gap,
the operators that began in it, the synchronising calls). The profiler's own overhead widens
gaps, the host profile's most, so compare gaps between contenders of one run, not their size.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import tempfile
import time
import traceback

import torch

from benchmarks.gpu.bench_gpu import FASTFFN_KERNELS, GEMM_KERNEL_MARKS, environment, liger_patched
from benchmarks.gpu.bench_step import (STEP_CONFIGS, fused_master_adamw, hf_config,
                                       new_hf_model, training_step)

OPTIMIZER_MARKS = ("adamw", "adam", "foreach", "multi_tensor", "update_pows")
LOSS_MARKS = ("cross_entropy", "liger_cross_entropy", "log_softmax", "nll_loss")


def category(name: str) -> str:
    low = name.lower()
    if any(s in low for s in GEMM_KERNEL_MARKS):
        return "gemm"
    if any(s in low for s in ("flash", "fmha", "attention", "cudnn", "sdpa")):
        return "attention"
    if any(s in low for s in OPTIMIZER_MARKS):
        return "optimizer"
    if any(s in low for s in LOSS_MARKS):
        return "loss"
    if any(s in low for s in FASTFFN_KERNELS):
        return "fastffn"
    return "other"


class Trace:
    """The GPU events (kernels, memcpys, memsets) of a chrome trace, and, when the host was
    profiled too, its operators and CUDA runtime calls, to say what the host did during a gap."""

    GPU = ("kernel", "gpu_memcpy", "gpu_memset")

    def __init__(self, trace_path: str):
        with open(trace_path) as f:
            events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
        rows = lambda cats: sorted((float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", ""),  # noqa: E731
                                    (e.get("args") or {}).get("correlation"))
                                   for e in events if e.get("cat") in cats)
        self.gpu = rows(self.GPU)
        self.host_ops = rows(("cpu_op",))
        self.runtime = {corr: (ts, dur, name) for ts, dur, name, corr in rows(("cuda_runtime", "cuda_driver"))
                        if corr is not None}
        self.syncs = [(ts, dur, name) for ts, dur, name, _ in rows(("cuda_runtime", "cuda_driver"))
                      if "Synchronize" in name or name == "cudaMemcpyAsync"]

    def host_during(self, start: float, end: float, next_correlation) -> dict:
        """What the host did in [start, end): the operator that launched the GPU work ending the
        gap (the innermost one around its launch call), the operators that began in the gap
        (their total time, by name, nested ones counted again) and the synchronising calls."""
        launch = self.runtime.get(next_correlation)
        launcher = None
        if launch is not None:
            around = [(dur, name) for ts, dur, name, _ in self.host_ops if ts <= launch[0] <= ts + dur]
            launcher = min(around)[1] if around else None
        began = {}
        for ts, dur, name, _ in self.host_ops:
            if start <= ts < end:
                began[name] = began.get(name, 0.0) + dur
        waits = [name for ts, dur, name in self.syncs if ts < end and ts + dur > start]
        return {"launched_by": launcher,
                "host_ops_us": {k: round(v, 1) for k, v in sorted(began.items(), key=lambda kv: -kv[1])[:6]},
                "sync_calls": sorted(set(waits))}


def summarize(trace: Trace, steps: int, top: int = 25) -> dict:
    """Per-step busy time, idle time (uncovered span), categories, top kernels and top gaps."""
    events = trace.gpu
    if not events:
        return {"error": "the profiler recorded no GPU events"}
    span = events[-1][0] + events[-1][1] - events[0][0]
    busy, covered_to = 0.0, events[0][0]
    gaps = []
    by_name, by_cat = {}, {}
    previous = None
    for start, dur, name, correlation in events:
        end = start + dur
        if start > covered_to and previous is not None:
            gaps.append((start - covered_to, covered_to, start, previous, name, correlation))
        busy += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
        previous = name
        entry = by_name.setdefault(name[:160], [0.0, 0])
        entry[0] += dur
        entry[1] += 1
        cat = category(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + dur
    per_step = lambda us: us / steps / 1e3  # noqa: E731  (us over all steps -> ms per step)
    gaps.sort(reverse=True)
    return {"span_ms": per_step(span), "busy_ms": per_step(busy), "idle_ms": per_step(span - busy),
            "kernel_ms_by_category": {k: per_step(v) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n, "ms_per_step": per_step(t), "calls_per_step": c / steps,
                             "category": category(n)}
                            for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
            "gaps_over_20us_per_step": sum(1 for g in gaps if g[0] > 20) / steps,
            "idle_in_gaps_over_20us_ms": per_step(sum(g[0] for g in gaps if g[0] > 20)),
            "largest_gaps": [{"us": round(g, 1), "after": a[:90], "before": b[:90],
                              **(trace.host_during(g0, g1, corr) if trace.host_ops else {})}
                             for g, g0, g1, a, b, corr in gaps[:15]]}


def kernel_timeline(run, reps: int, with_host: bool = False, top: int = 25) -> dict:
    """summarize() of `reps` back-to-back calls of run() under torch.profiler: the GPU alone, or
    with the host's operators too."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if with_host else [])
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return summarize(Trace(path), reps, top)


def host_python_profile(step, steps: int, top: int = 40) -> dict:
    """Where the host's Python time goes in `steps` steps (cProfile: per function, its own time and
    with its callees, per step), started on a drained GPU; a host that waits on a full launch queue
    shows that wait inside the call that blocked. Backward runs on the
    calling thread here (autograd's device worker threads off): cProfile sees only the thread that
    enabled it, and on a GPU autograd runs every backward node on a worker thread of its own, where
    the custom Functions' backward would show only as run_backward's own time. cProfile's own
    overhead inflates every Python call by a similar factor: compare functions, not the total with
    a step time."""
    import cProfile
    import pstats

    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    synchronize()
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        started = time.perf_counter()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
        issued = time.perf_counter() - started
    synchronize()
    stats = pstats.Stats(profiler).stats
    rows = []
    for (path, line, function), (_, calls, own, cumulative, _) in stats.items():
        rows.append({"function": f"{os.path.relpath(path) if path.startswith('/') else path}:{line}({function})",
                     "calls_per_step": calls / steps, "own_ms_per_step": own * 1e3 / steps,
                     "cumulative_ms_per_step": cumulative * 1e3 / steps})
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return {"steps": steps, "host_ms_per_step_under_cprofile": issued * 1e3 / steps,
            "python_calls_per_step": sum(r["calls_per_step"] for r in rows), "by_own_time": rows[:top],
            "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_ms_per_step"])[:top]}


def profile_training(forward, model, make_optimizer, steps: int, warmup: int = 3, accumulation: int = 1) -> dict:
    """Three profiles of `steps` steps (each `accumulation` forward+backward passes, then the
    optimizer): the GPU alone (idle as the GPU sees it, the profiler's host overhead kept small), the
    GPU with the host's operators (what the host did in each gap; its gaps are wider by the
    profiler's own overhead) and the host's Python functions (host_python_profile)."""
    step = training_step(forward, model, make_optimizer(model.parameters()), accumulation)
    for _ in range(warmup):
        step()
    return {"gpu_only": kernel_timeline(step, steps), "with_host": kernel_timeline(step, steps, with_host=True),
            "host_python": host_python_profile(step, steps)}


def main():
    from paddle_fastffn.torch.llama import shift_labels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", nargs="+", default=["llama2_7b_8layers"])
    parser.add_argument("--contenders", nargs="+", default=["ours", "hf_liger"])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    report = {"environment": environment(),
              "command": "python3 -m benchmarks.gpu.profile_step " + " ".join(
                  f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()),
              "note": __doc__.split("\n\n")[-1].replace("\n", " ")}
    started = time.time()

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    for config_name in args.configs:
        shape = STEP_CONFIGS[config_name]
        config = hf_config(shape)
        torch.manual_seed(0)
        base = new_hf_model(config)
        ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device="cuda")
        labels = shift_labels(ids)
        builders = profile_contenders(config, base, ids, labels)
        results = report[config_name] = {}
        for name in args.contenders:
            patch = liger_patched(fused_linear_cross_entropy=True) if name == "hf_liger" else contextlib.nullcontext()
            try:
                with patch:
                    model, forward, make_optimizer = builders[name]()
                    results[name] = profile_training(forward, model, make_optimizer, args.steps)
                del model, forward
            except Exception as error:  # noqa: BLE001
                results[name] = {"error": repr(error), "trace": traceback.format_exc()[-2500:]}
            gc.collect()
            torch.cuda.empty_cache()
            r = results[name].get("gpu_only", results[name])
            print(f"{config_name} {name}: span {r.get('span_ms', 0):.2f} ms, busy {r.get('busy_ms', 0):.2f}, idle "
                  f"{r.get('idle_ms', 0):.2f}, {r.get('kernel_ms_by_category', r.get('error'))} at "
                  f"{time.time() - started:.0f}s", flush=True)
            save()
        base = builders = None
        gc.collect()
        torch.cuda.empty_cache()
    save()
    print(f"wrote {args.out}")


def profile_contenders(config, base, ids, labels):
    """{contender: build() -> (model, forward() -> loss, make_optimizer)} on ids' device; hf_liger is
    built and run inside liger_patched(fused_linear_cross_entropy=True)."""
    from paddle_fastffn.torch.fp8.ffn import Fp8Recipe
    from paddle_fastffn.torch.llama import FastLlama

    def ours(kind=None, lm_head="bf16"):
        model = FastLlama(base, fp8_recipe=None if kind is None else Fp8Recipe(scaling=kind, lm_head=lm_head))
        return model, lambda: model(ids, labels), fused_master_adamw

    return {
        "ours": ours,
        "ours_fp8_current": lambda: ours("current"),
        "ours_fp8_delayed": lambda: ours("delayed"),
        "ours_fp8_delayed_fp8_head": lambda: ours("delayed", lm_head="fp8"),
        "hf_liger": lambda: (lambda m: (m, lambda: m(input_ids=ids, labels=ids).loss, fused_master_adamw))(
            _copy_of(base, config)),
        "hf_eager": lambda: (lambda m: (m, lambda: m(input_ids=ids, labels=ids).loss, fused_master_adamw))(
            _copy_of(base, config)),
    }


def _copy_of(base, config):
    """A fresh Hugging Face model with base's weights (built inside liger_patched for hf_liger)."""
    model = new_hf_model(config, base.device)
    model.load_state_dict(base.state_dict())
    return model


if __name__ == "__main__":
    main()
