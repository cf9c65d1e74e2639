"""Every value of rotary.cu's FASTFFN_ROTARY_HEADS_PER_THREAD knob (build_definition's
ROTARY_HEADS_PER_THREAD, which bench_gpu.py's rope_sweep section builds on the GPU machine)
compiles for every architecture of the build definition without register spills: a sweep value that
spilled or failed to build would cost its device call, found only there."""

import re

import pytest

from build_tools import require_tool, run
from test_cuda_build import ptxas_functions

from paddle_fastffn.ops import build_definition

ROTARY = build_definition.csrc_root() / "kernels" / "cuda" / "rotary.cu"


@pytest.mark.parametrize("heads_per_thread", build_definition.ROTARY_HEADS_PER_THREAD)
def test_rotary_heads_per_thread_compiles_without_spills(heads_per_thread, tmp_path):
    require_tool("nvcc")
    define = f"-DFASTFFN_ROTARY_HEADS_PER_THREAD={heads_per_thread}"
    report = run(build_definition.nvcc_compile_command(ROTARY, tmp_path / "rotary.o",
                                                       [define, "-Xptxas=-v"])).stderr
    functions = list(ptxas_functions(report))
    # rotary_kernel<T, V, kInverse, kHeads>: the knob reached the template (its last argument)
    kernels = [(name, arch, spilled) for name, arch, spilled in functions if "rotary_kernel" in name]
    heads = {int(re.search(r"ELi(\d+)EEEv", name).group(1)) for name, _, _ in kernels}
    assert heads == {heads_per_thread}, f"{define}: kernels built for heads per thread {heads}"
    # 3 dtypes x (vector, scalar) x (forward, inverse) per architecture
    for arch in build_definition.CUDA_ARCHS:
        assert sum(a == f"sm_{arch}" for _, a, _ in kernels) == 12, f"{define}: sm_{arch} variants"
    spilled = [(name, arch, b) for name, arch, b in kernels if b]
    assert not spilled, f"{define}: register spills {spilled}"
