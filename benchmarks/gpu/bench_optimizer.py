"""The optimizer step on the H200: our one-pass AdamW kernel against stock Paddle's AdamW (the
optimizer Paddle users run), on the parameters of the whole-step benchmark's models, every
contender in the same run, timed round-robin:

    python3 -m benchmarks.gpu.bench_optimizer --out optimizer.json [--configs llama2_7b_8layers ...]
        [--low-memory with|without|only]

- ours: paddle_fastffn.torch.llama.FusedMasterAdamW, one fastffn_adamw_cuda call per parameter (the kernel
  paddle_fastffn.optim.FastAdamW runs in Paddle): reads the bf16 gradient, the fp32 master, m
  and v, writes master, m, v and the bf16 parameter: 28 bytes per parameter.
- paddle: paddle_adamw.PaddleAdamW, stock Paddle's AdamW (paddle.optimizer.AdamW,
  multi_precision) ported into the harness launch for launch: its AdamWKernelREG, 28 bytes per
  parameter too, one launch per parameter, beta powers on the host.
- three_pass: paddle_fastffn.torch.llama.MasterWeightAdamW, the harness's stand-in of runs up to 14 (bf16
  gradients copied into fp32 buffers, torch's fused AdamW on the masters, masters copied back:
  40 bytes per parameter and 4 more resident); kept to show what that baseline measured.
- the low-memory state at full LLaMA-2-7B depth (6.74e9 parameters, no fp32 master), each optimizer
  as its users set it up (bench_full_depth's full_low_memory rows): ours_int8_compensated,
  FusedMasterAdamW(moments="int8", master_weights="compensated") (8-bit blockwise moments,
  Kahan-compensated bf16 weights: weight 2+2, compensation 2+2, gradient 2, codes 1+1 per moment,
  14 bytes per parameter); torch_fused_bf16, torch.optim.AdamW(fused=True) on the bf16 weights
  (bf16 moments, 14 bytes); torchao_adamw8bit, torchao's AdamW8bit (8-bit moments, no
  compensation, 10 bytes); the absmax (8 bytes per 256 parameters) not counted. No clipping.
Each of the first three without clipping and with the global-norm clip (max_grad_norm 1.0). Ours reads each bf16
gradient once more for the norm and scales it as it reads it (+2 bytes); Paddle's
ClipGradByGlobalNorm reduces each gradient's squared norm and then scales it in place (+2 read,
+2 read +2 write: +6); torch's clip_grad_norm_ reads the fp32 gradients for the norm and scales
them in place (+12).

The parameters: embedding, 8 decoder layers with the fast path's fused weights (qkv, o, gate_up,
down, two norm weights), final norm and LM head, all bf16 (what paddle_fastffn.torch.llama.FastLlama trains), at
bench_step's LLaMA-2-7B and Llama-3-8B widths. Time per step: CUDA events around step() called
from Python (what a training loop sees) and the step captured in a CUDA graph (the GPU's time);
the fraction of the device copy bandwidth measured in the same run (bytes as above / time).
Three contenders' optimizer states do not fit beside each other at Llama-3-8B width, so each
round builds, times and frees every contender in turn, in an order rotated by one per round
(bench_gpu.round_robin_rebuilt), at least 3 rounds: median over rounds and spread
(benchmarks/common.py: TIE_RULE).

--sweep: our kernel also built with each of SWEEP_VARIANTS' build-time knobs (csrc/kernels/cuda/
adamw.cu), measured beside the default build on the first config without clipping.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import time
import traceback

import torch

from benchmarks.gpu.bench_full_depth import fused_torch_adamw, int8_compensated_adamw, torchao_adamw8bit
from benchmarks.gpu.bench_gpu import ceilings, environment, graphed, round_robin_rebuilt, timeit
from benchmarks.gpu.bench_step import STEP_CONFIGS
from benchmarks.gpu.paddle_adamw import PaddleAdamW
from paddle_fastffn.torch import c_api
from paddle_fastffn.torch.llama import FusedMasterAdamW, MasterWeightAdamW

OPTIMIZERS = {"ours": FusedMasterAdamW, "paddle": PaddleAdamW, "three_pass": MasterWeightAdamW}
# make_optimizer(params) of the low-memory section, without clipping.
LOW_MEMORY_OPTIMIZERS = {"ours_int8_compensated": int8_compensated_adamw, "torch_fused_bf16": fused_torch_adamw,
                         "torchao_adamw8bit": torchao_adamw8bit}
LOW_MEMORY_CONFIG = "llama2_7b"
LOW_MEMORY_SHAPE = {**STEP_CONFIGS["llama2_7b_8layers"], "layers": 32}
BYTES_PER_PARAM = {"ours": 28, "paddle": 28, "three_pass": 40,
                   "ours_int8_compensated": 14, "torch_fused_bf16": 14, "torchao_adamw8bit": 10}
CLIP_BYTES_PER_PARAM = {"ours": 2, "paddle": 6, "three_pass": 12}
# masters or compensation, m, v (+ fp32 grads)
RESIDENT_BYTES_PER_PARAM = {"ours": 12, "paddle": 12, "three_pass": 16,
                            "ours_int8_compensated": 4, "torch_fused_bf16": 4, "torchao_adamw8bit": 2}


# Build-time knobs of adamw.cu tried against its defaults (8 blocks per SM, 8 elements per thread).
SWEEP_VARIANTS = (("FASTFFN_ADAMW_BLOCKS_PER_SM=4",), ("FASTFFN_ADAMW_ELEMS=16",))


def parameter_shapes(hidden, inter, heads, kv_heads, layers, vocab, **_):
    """The fast path's trainable tensors (paddle_fastffn.torch.llama.FastLlama) for one step-benchmark config."""
    head_dim = hidden // heads
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, hidden), (2 * inter, hidden),
             (hidden, inter), (hidden,), (hidden,)]
    return [(vocab, hidden)] + layer * layers + [(hidden,), (hidden, vocab)]


def make_contender(name, shapes, clip, grads):
    """Fresh bf16 parameters (whose .grad are the shared gradients, on their device) and the optimizer."""
    params = [(torch.randn(s, device=grads[0].device) * 0.02).to(torch.bfloat16).requires_grad_() for s in shapes]
    if name in LOW_MEMORY_OPTIMIZERS:
        assert not clip, "the low-memory section runs without clipping"
        opt = LOW_MEMORY_OPTIMIZERS[name](params)
    else:
        opt = OPTIMIZERS[name](params, lr=1e-5, max_grad_norm=1.0 if clip else None)
    if name in ("three_pass", "torch_fused_bf16"):
        torch_optimizer = opt.optimizer if name == "three_pass" else opt
        torch_optimizer.param_groups[0]["capturable"] = True  # device step counts: graph capture works

    def step():
        # Paddle's clip scales the shared gradients in place: after the first step their norm is at
        # most max_norm and the coefficient 1, the same traffic (a copy per step would add 4 bytes per
        # parameter to every clipped row).
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return params, opt, step


def measure(name, shapes, clip, grads, reps):
    """One round of one contender: {eager_ms, graph_ms} (medians of `reps` steps) and its sizes."""
    params, opt, step = make_contender(name, shapes, clip, grads)
    n = sum(p.numel() for p in params)
    row = {"impl": name, "clip": clip, "parameters": n, "tensors": len(params),
           "bytes_per_parameter": BYTES_PER_PARAM[name] + (CLIP_BYTES_PER_PARAM.get(name, 0) if clip else 0),
           "resident_optimizer_bytes": n * RESIDENT_BYTES_PER_PARAM[name]}
    row["eager_ms"] = timeit(step, reps=reps, warmup=3, flush=False)["p50_ms"]
    try:
        row["graph_ms"] = timeit(graphed(step), reps=reps, warmup=2, flush=False)["p50_ms"]
    except Exception as error:  # noqa: BLE001
        row["graph_error"] = {"error": repr(error), "trace": traceback.format_exc()[-1500:]}
    del params, opt, step
    return row


def with_bandwidth(row, copy_bw):
    """Adds GB/s and the fraction of the copy bandwidth to each timing of a summarised row."""
    nbytes = row["parameters"] * row["bytes_per_parameter"]
    for mode in ("eager", "graph"):
        if isinstance(row.get(mode), dict) and "p50_ms" in row[mode]:
            rate = nbytes / (row[mode]["p50_ms"] * 1e-3)
            row[mode].update({"GB_per_s": rate / 1e9, "fraction_of_copy": rate / copy_bw})
    if "graph" in row:  # the GPU's time: what common.compare reads
        row.update({k: row["graph"][k] for k in ("p50_ms", "p20_ms", "p80_ms", "spread_ms", "repeats")
                    if k in row["graph"]})
    return row


def sweep_section(shapes, grads, copy_bw, reps):
    """Our kernel per SWEEP_VARIANTS build (built in parallel first), the default build last again."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(SWEEP_VARIANTS)) as pool:
        libraries = list(pool.map(lambda defines: c_api.build(defines=defines), SWEEP_VARIANTS))
    default = c_api._KERNELS
    rows = []
    try:
        for defines, library in [((), None)] + list(zip(SWEEP_VARIANTS, libraries)) + [((), None)]:
            c_api._KERNELS = c_api.Kernels(library) if library is not None else default
            row = measure("ours", shapes, False, grads, reps)
            # one measurement per build, in the layout of the report's sweep table
            row = with_bandwidth({**row, "eager": {"p50_ms": row["eager_ms"]},
                                  "graph": {"p50_ms": row.get("graph_ms", float("nan"))}}, copy_bw)
            row["defines"] = list(defines)
            rows.append(row)
            print(f"sweep {defines or 'default'}: graph {row.get('graph_ms')} ms", flush=True)
    finally:
        c_api._KERNELS = default
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", nargs="+", default=list(STEP_CONFIGS))
    parser.add_argument("--reps", type=int, default=15, help="steps timed per contender per round")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds (at least 3)")
    parser.add_argument("--sweep", action="store_true", help="also the SWEEP_VARIANTS builds of our kernel")
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep (first config)")
    parser.add_argument("--low-memory", choices=("with", "without", "only"), default="with",
                        help=f"the low-memory section ({LOW_MEMORY_CONFIG}, full depth) after the configs, "
                             "not at all, or alone")
    args = parser.parse_args()
    started = time.time()
    report = {"environment": environment(),
              "command": "python3 -m benchmarks.gpu.bench_optimizer " + " ".join(
                  f"--{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()),
              "note": "ours: fastffn_adamw_cuda through ctypes (the kernel of paddle_fastffn.optim.FastAdamW); "
                      "paddle: stock Paddle's AdamW kernel and ClipGradByGlobalNorm ported into the harness "
                      "(benchmarks/gpu/paddle_adamw.py); three_pass: torch's copies and fused AdamW (the "
                      "stand-in of runs up to 14); low_memory: ours int8 moments + compensated bf16 weights, "
                      "torch's fused AdamW on bf16 weights, torchao's AdamW8bit, at full 7B depth."}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    report["ceilings"] = ceilings()
    copy_bw = report["ceilings"]["copy_bytes_per_s"]
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    if args.sweep or args.sweep_only:
        shapes = parameter_shapes(**STEP_CONFIGS[args.configs[0]])
        grads = [(torch.randn(s, device="cuda") * 1e-3).to(torch.bfloat16) for s in shapes]
        report["sweep"] = {"config": args.configs[0], "rows": sweep_section(shapes, grads, copy_bw, args.reps)}
        save()
        del grads
        gc.collect()
        torch.cuda.empty_cache()
    def section(key, shapes, names_and_clips):
        """report[key]: each (contender, clip) round-robin over args.rounds, on shared gradients."""
        grads = [(torch.randn(s, device="cuda") * 1e-3).to(torch.bfloat16) for s in shapes]
        builders = {f"{name}{'_clip' if clip else ''}":
                    (lambda name=name, clip=clip: measure(name, shapes, clip, grads, args.reps))
                    for name, clip in names_and_clips}

        def progress(contender, index, row):
            """Prints and saves each contender's round (replaced by the summary when all are done)."""
            print(f"{key} {contender} round {index}: eager {row.get('eager_ms', row.get('error'))} ms, "
                  f"graph {row.get('graph_ms')} ms at {time.time() - started:.0f}s", flush=True)
            report.setdefault(key, {}).setdefault("rounds_so_far", []).append(
                {"contender": contender, "round": index, **row})
            save()

        results = round_robin_rebuilt(builders, args.rounds, progress)
        report[key] = {name: with_bandwidth(row, copy_bw) if "parameters" in row else row
                       for name, row in results.items()}
        save()
        del builders, grads  # the next section's state needs the memory
        gc.collect()
        torch.cuda.empty_cache()

    only_low_memory = args.sweep_only or args.low_memory == "only"
    for config in ([] if only_low_memory else args.configs):
        section(config, parameter_shapes(**STEP_CONFIGS[config]),
                [(name, clip) for clip in (False, True) for name in OPTIMIZERS])
    if args.low_memory != "without" and not args.sweep_only:
        section(f"{LOW_MEMORY_CONFIG}_low_memory", parameter_shapes(**LOW_MEMORY_SHAPE),
                [(name, False) for name in LOW_MEMORY_OPTIMIZERS])
    save()
    print(f"wrote {args.out} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
