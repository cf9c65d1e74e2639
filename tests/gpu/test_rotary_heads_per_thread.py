"""rotary.cu's FASTFFN_ROTARY_HEADS_PER_THREAD builds other than the default (build_definition's
ROTARY_HEADS_PER_THREAD, which bench_gpu.py's rope_sweep section times): test_cuda_kernels.py's
rotary tests run again on each build's library, so a build the sweep may pick is held to the same
fp64 references and tolerances (gpu_checks.TOL, tests/tolerances.py's table) as the default: q
and k dense or token-strided, forward and the transposed rotation in backward, grouped-query heads,
position ids and implicit positions, scalar and vector paths, the interleaved fused qkv with v's
copy, and an out-of-table position flagged, poisoned and raised."""

import re

import pytest
import torch

from paddle_fastffn.torch import c_api, ops

import test_cuda_kernels as rotary_tests

VARIANTS = [h for h in c_api.definition.ROTARY_HEADS_PER_THREAD if h != 1]


@pytest.fixture(scope="module")
def libraries():
    return c_api.rotary_heads_per_thread_kernels()


@pytest.fixture(autouse=True, params=VARIANTS, ids=lambda h: f"heads_per_thread_{h}")
def heads_per_thread(request, libraries):
    """Every test of this module runs on that build's library (c_api.kernels() returns it)."""
    default = c_api._KERNELS
    c_api._KERNELS = libraries[request.param]
    yield request.param
    c_api._KERNELS = default


# test_cuda_kernels' own tests and parametrizations, collected here under the fixture above.
test_rotary = rotary_tests.test_rotary
test_qkv_rotary_reads_and_writes_the_interleaved_fused_qkv = (
    rotary_tests.test_qkv_rotary_reads_and_writes_the_interleaved_fused_qkv)
test_rotary_position_out_of_range_raises_instead_of_clamping = (
    rotary_tests.test_rotary_position_out_of_range_raises_instead_of_clamping)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_build_launches_its_heads_per_thread_kernel(heads_per_thread, dtype):
    """The define reached the library these tests ran: the launched rotary_kernel's last template
    argument (kHeads) is the build's value (else the tests above re-tested the default kernel)."""
    from torch.profiler import ProfilerActivity, profile

    q, k = rotary_tests.rand((2, 16, 8, 64), dtype), rotary_tests.rand((2, 16, 2, 64), dtype)
    cos, sin = rotary_tests._rope_tables(64, 16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.Rotary.apply(q, k, cos, sin, None)
        torch.cuda.synchronize()
    launched = [re.search(r"rotary_kernel<([^<>]*)>", e.key) for e in prof.key_averages()]
    heads = {int(m.group(1).split(",")[-1]) for m in launched if m}
    assert heads == {heads_per_thread}, f"rotary_kernel launched with kHeads {heads}"
