"""The CPU kernels' threading: they run on Paddle's own OpenMP runtime (one thread pool, Paddle's
thread count; build_definition.paddle_openmp_link_flags), and a kernel split across threads
computes what the single-threaded one does (kernels below cpu_common.h's size threshold always run
on one thread, so the op tests at small shapes never reach the split)."""

import shutil
import subprocess

import paddle
import pytest

from helpers import random_tensor
from paddle_fastffn import ops
from paddle_fastffn.ops import _loader
from tolerances import assert_close

PADDLE_IOMP5 = _loader.paddle_libs() / "libiomp5.so"


@pytest.mark.skipif(not PADDLE_IOMP5.is_file(), reason="this Paddle wheel ships no libiomp5 (it uses libgomp)")
@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) is not installed")
def test_kernels_link_paddles_openmp_runtime():
    _loader.ensure_loaded()
    dynamic = subprocess.run(["readelf", "-d", str(_loader.library_path())], capture_output=True,
                             text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert "libiomp5.so" in needed and "libgomp.so.1" not in needed, needed


def run_with_threads(threads: int, fn):
    runtime = _loader.openmp_runtime()
    before = runtime.omp_get_max_threads()
    runtime.omp_set_num_threads(threads)
    try:
        return fn()
    finally:
        runtime.omp_set_num_threads(before)


def swiglu_and_grad(gate_up, upstream):
    out = ops.swiglu(gate_up)
    return [out, *paddle.grad(out, [gate_up], upstream)]


def rms_norm_and_grads(x, w, upstream):
    out = ops.rms_norm(x, w, 1e-5)
    return [out, *paddle.grad(out, [x, w], upstream)]


def test_split_kernels_match_one_thread(kernel_calls):
    # 1024 x 704 SwiGLU and 2048 x 256 RMSNorm: 4-5x the per-thread minimum, so both threads run.
    gate_up = random_tensor((1024, 2 * 704), paddle.float32, scale=2.0)
    x, w = random_tensor((2048, 256), paddle.float32, scale=3.0), random_tensor((256,), paddle.float32)
    up_swiglu = random_tensor((1024, 704), paddle.float32, requires_grad=False)
    up_norm = random_tensor((2048, 256), paddle.float32, requires_grad=False)
    for case, (one, two) in {
        "swiglu": [run_with_threads(t, lambda: swiglu_and_grad(gate_up, up_swiglu)) for t in (1, 2)],
        "rms_norm": [run_with_threads(t, lambda: rms_norm_and_grads(x, w, up_norm)) for t in (1, 2)],
    }.items():
        # Row-parallel outputs do the same math per row whatever the split: bit-identical.
        for i, (a, b) in enumerate(zip(one[:2], two[:2])):
            assert paddle.equal_all(a, b).item(), f"{case} output {i} differs between 1 and 2 threads"
    # RMSNorm's weight gradient sums per-thread partials: only the summation order differs.
    assert_close(two[2], one[2], paddle.float32, "rms_norm d_weight, 2 threads vs 1", reduced_rows=2048)
    assert kernel_calls()["fastffn_rms_norm_bwd"] == 2 and kernel_calls()["fastffn_swiglu_bwd"] == 2, kernel_calls()
