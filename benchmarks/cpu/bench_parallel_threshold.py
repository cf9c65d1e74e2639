"""CPU: where an OpenMP-parallel kernel starts to pay. Each fused op forward+backward at the demo
model's widths over a range of token counts, run with 1 thread and with all threads of Paddle's
OpenMP runtime (the one the kernels are linked to), alternating, minimum of many repeats (the
least disturbed run on a shared machine).

    python -m benchmarks.cpu.bench_parallel_threshold [--repeats 200]

Writes benchmarks/results/cpu_parallel_threshold.json. Sets the runtime's thread count with
omp_set_num_threads, which caps any later parallel region of the calling thread; a kernel that
chooses fewer threads by size (cpu_common.h, parallel_threads) runs the same in both columns below
its threshold, so this measures the kernels as built.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import paddle

from benchmarks.common import cpu_model, write_results
from paddle_fastffn import ops
from paddle_fastffn.ops._loader import openmp_runtime

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 256, 704, 8, 4, 32  # the demo model


def leaf(shape):
    t = paddle.to_tensor(np.random.randn(*shape).astype("float32"))
    t.stop_gradient = False
    return t


def cases(tokens: int):
    x = leaf((tokens, HIDDEN))
    w = leaf((HIDDEN,))
    gate_up = leaf((tokens, 2 * INTERMEDIATE))
    yield "swiglu", tokens * INTERMEDIATE, lambda: ops.swiglu(gate_up), [gate_up]
    yield "rms_norm", tokens * HIDDEN, lambda: ops.rms_norm(x, w, 1e-5), [x, w]


def fwd_bwd(fn, inputs):
    out = fn()
    out.backward(paddle.ones_like(out))
    for t in inputs:
        t.clear_gradient(set_to_zero=False)


def best_ms(fn, inputs, repeats):
    fwd_bwd(fn, inputs)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fwd_bwd(fn, inputs)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    runtime = openmp_runtime()
    max_threads = runtime.omp_get_max_threads()
    load_start = os.getloadavg()
    rows = []
    print(f"{'op':10s}{'tokens':>8s}{'elements':>10s}{'1 thread ms':>13s}{f'{max_threads} threads ms':>13s}")
    for tokens in args.tokens:
        for name, elements, fn, inputs in cases(tokens):
            ms = {}
            for threads in (1, max_threads, 1, max_threads):  # alternated, best of both passes
                runtime.omp_set_num_threads(threads)
                ms[threads] = min(ms.get(threads, float("inf")), best_ms(fn, inputs, args.repeats // 2))
            runtime.omp_set_num_threads(max_threads)
            rows.append({"op": name, "tokens": tokens, "elements": elements, "ms_1_thread": ms[1],
                         f"ms_{max_threads}_threads": ms[max_threads]})
            print(f"{name:10s}{tokens:8d}{elements:10d}{ms[1]:13.4f}{ms[max_threads]:13.4f}")
    path = write_results("cpu_parallel_threshold", {
        "device": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "versions": {"paddle": paddle.__version__},
        "what": ("fused op forward+backward (float32, demo widths: hidden 256, SwiGLU 704), best of "
                 f"{args.repeats} in two alternated passes, 1 thread vs {max_threads} threads of the "
                 "OpenMP runtime the ops are linked to"),
        "openmp_runtime": runtime._name, "load_average": {"start": load_start, "end": os.getloadavg()},
        "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
