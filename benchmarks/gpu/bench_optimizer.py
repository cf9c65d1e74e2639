"""The optimizer step on the H200: our one-pass AdamW kernel against the three passes of the harness's
stand-in, on the parameters of the whole-step benchmark's models, every contender in the same run:

    python3 -m benchmarks.gpu.bench_optimizer --out optimizer.json [--configs llama2_7b_8layers ...]

- ours: llama_model.FusedMasterAdamW, one fastffn_adamw_cuda call per parameter (the kernel
  paddle_fastffn.optim.FastAdamW runs in Paddle): reads the bf16 gradient, the fp32 master, m
  and v, writes master, m, v and the bf16 parameter: 28 bytes per parameter.
- three_pass: llama_model.MasterWeightAdamW (bench_step's optimizer): bf16 gradients copied into
  fp32 buffers (6 bytes), torch's fused AdamW on the fp32 masters (28), masters copied back into
  the bf16 parameters (6): 40 bytes per parameter, and 4 more resident per parameter.
Both without clipping and with the global-norm clip (max_grad_norm 1.0: ours reads each bf16
gradient once more for the norm, +2 bytes; torch's clip_grad_norm_ reads the fp32 gradients for
the norm and scales them in place, +12).

The parameters: embedding, 8 decoder layers with the fast path's fused weights (qkv, o, gate_up,
down, two norm weights), final norm and LM head, all bf16 (what llama_model.FastLlama trains), at
bench_step's LLaMA-2-7B and Llama-3-8B widths. Time per step: CUDA events around step() called
from Python (what a training loop sees) and the step captured in a CUDA graph (the GPU's time);
the fraction of the device copy bandwidth measured in the same run (bytes as above / time).

--sweep: our kernel also built with each of SWEEP_VARIANTS' build-time knobs (csrc/kernels/cuda/
adamw.cu), measured beside the default build on the first config without clipping.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback

import torch

import concurrent.futures

from benchmarks.gpu import harness
from benchmarks.gpu.bench_gpu import ceilings, environment, graphed, timeit
from benchmarks.gpu.bench_step import STEP_CONFIGS
from benchmarks.gpu.llama_model import FusedMasterAdamW, MasterWeightAdamW

BYTES_PER_PARAM = {"ours": 28, "three_pass": 40}
CLIP_BYTES_PER_PARAM = {"ours": 2, "three_pass": 12}


# Build-time knobs of adamw.cu tried against its defaults (8 blocks per SM, 8 elements per thread).
SWEEP_VARIANTS = (("FASTFFN_ADAMW_BLOCKS_PER_SM=4",), ("FASTFFN_ADAMW_ELEMS=16",))


def parameter_shapes(hidden, inter, heads, kv_heads, layers, vocab, **_):
    """The fast path's trainable tensors (llama_model.FastLlama) for one step-benchmark config."""
    head_dim = hidden // heads
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, hidden), (2 * inter, hidden),
             (hidden, inter), (hidden,), (hidden,)]
    return [(vocab, hidden)] + layer * layers + [(hidden,), (hidden, vocab)]


def make_contender(name, shapes, clip, grads):
    """Fresh bf16 parameters (whose .grad are the shared gradients) and the optimizer."""
    params = [(torch.randn(s, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_() for s in shapes]
    cls = FusedMasterAdamW if name == "ours" else MasterWeightAdamW
    opt = cls(params, lr=1e-5, max_grad_norm=1.0 if clip else None)
    if name == "three_pass":
        opt.optimizer.param_groups[0]["capturable"] = True  # device step counts: graph capture works

    def step():
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return params, opt, step


def measure(name, shapes, clip, grads, copy_bw, reps):
    params, opt, step = make_contender(name, shapes, clip, grads)
    n = sum(p.numel() for p in params)
    row = {"impl": name, "clip": clip, "parameters": n, "tensors": len(params),
           "bytes_per_parameter": BYTES_PER_PARAM[name] + (CLIP_BYTES_PER_PARAM[name] if clip else 0)}
    nbytes = n * row["bytes_per_parameter"]
    row["eager"] = timeit(step, reps=reps, warmup=3, flush=False)
    try:
        row["graph"] = timeit(graphed(step), reps=reps, warmup=2, flush=False)
    except Exception as error:  # noqa: BLE001
        row["graph"] = {"error": repr(error), "trace": traceback.format_exc()[-1500:]}
    for mode in ("eager", "graph"):
        if "p50_ms" in row[mode]:
            rate = nbytes / (row[mode]["p50_ms"] * 1e-3)
            row[mode].update({"GB_per_s": rate / 1e9, "fraction_of_copy": rate / copy_bw})
    row["resident_optimizer_bytes"] = n * (16 if name == "three_pass" else 12)  # masters, m, v (+ fp32 grads)
    del params, opt, step
    gc.collect()
    torch.cuda.empty_cache()
    return row


def sweep_section(shapes, grads, copy_bw, reps):
    """Our kernel per SWEEP_VARIANTS build (built in parallel first), the default build last again."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(SWEEP_VARIANTS)) as pool:
        libraries = list(pool.map(lambda defines: harness.build(defines=defines), SWEEP_VARIANTS))
    default = harness._KERNELS
    rows = []
    try:
        for defines, library in [((), None)] + list(zip(SWEEP_VARIANTS, libraries)) + [((), None)]:
            harness._KERNELS = harness.Kernels(library) if library is not None else default
            row = measure("ours", shapes, False, grads, copy_bw, reps)
            row["defines"] = list(defines)
            rows.append(row)
            print(f"sweep {defines or 'default'}: graph {row['graph'].get('p50_ms')} ms "
                  f"({row['graph'].get('fraction_of_copy', 0):.3f} of copy)", flush=True)
    finally:
        harness._KERNELS = default
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", nargs="+", default=list(STEP_CONFIGS))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sweep", action="store_true", help="also the SWEEP_VARIANTS builds of our kernel")
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep (first config)")
    args = parser.parse_args()
    started = time.time()
    report = {"environment": environment(),
              "command": "python3 -m benchmarks.gpu.bench_optimizer " + " ".join(
                  f"--{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()),
              "note": "ours: fastffn_adamw_cuda through ctypes (the kernel of paddle_fastffn.optim.FastAdamW); "
                      "three_pass: torch's copies and fused AdamW (the harness's stand-in for Paddle's AdamW)."}

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
    for config in ([] if args.sweep_only else args.configs):
        shapes = parameter_shapes(**STEP_CONFIGS[config])
        grads = [(torch.randn(s, device="cuda") * 1e-3).to(torch.bfloat16) for s in shapes]
        rows = report.setdefault(config, [])
        for clip in (False, True):
            for name in ("ours", "three_pass"):
                try:
                    row = measure(name, shapes, clip, grads, copy_bw, args.reps)
                except Exception as error:  # noqa: BLE001
                    row = {"impl": name, "clip": clip, "error": repr(error), "trace": traceback.format_exc()[-2000:]}
                rows.append(row)
                save()
                print(f"{config} {name} clip={clip}: eager {row.get('eager', {}).get('p50_ms')} ms, graph "
                      f"{row.get('graph', {}).get('p50_ms')} ms ({row.get('graph', {}).get('fraction_of_copy', 0):.2f} "
                      f"of copy) at {time.time() - started:.0f}s", flush=True)
        del grads
        gc.collect()
        torch.cuda.empty_cache()
    save()
    print(f"wrote {args.out} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
