"""The optimizer benchmark's baseline (benchmarks/gpu/paddle_adamw.cu: stock Paddle's AdamW kernel
and its clip's squared-norm reduction, ported into the GPU harness) compiles with the command the
harness uses, for every architecture of the build definition, without register spills, and its
entry points reject what Paddle does not register before launching anything (callable here, with
no GPU)."""

import ctypes

from benchmarks.gpu import paddle_adamw_library

from build_tools import require_tool, run
from test_cuda_build import ptxas_functions

from paddle_fastffn.ops import build_definition

CUDA_ERROR_INVALID_VALUE = 1


def test_paddle_adamw_baseline_compiles_without_spills_and_rejects_bad_dtypes(tmp_path):
    require_tool("nvcc")
    library = tmp_path / "paddle_adamw.so"
    report = run(paddle_adamw_library.compile_command(library, ["-Xptxas=-v"])).stderr
    functions = list(ptxas_functions(report))
    assert {arch for _, arch, _ in functions} == {f"sm_{arch}" for arch in build_definition.CUDA_ARCHS}
    kernels = {name for name, _, _ in functions}
    for kernel in ("paddle_adamw_reg_kernel", "squared_partials_kernel", "sum_partials_kernel"):
        assert any(kernel in name for name in kernels), f"{kernel} missing from {sorted(kernels)}"
    spilled = [(name, arch, b) for name, arch, b in functions if b]
    assert not spilled, f"register spills {spilled}"

    lib = paddle_adamw_library.load(library)
    null = None
    hyper = (0.9, 0.95, 1e-8, 0.01, 1.0, 1, 0.9, 0.95)
    pointers = (null,) * 7
    assert lib.paddle_adamw_cuda(4, 2, 1, *hyper, *pointers) == CUDA_ERROR_INVALID_VALUE  # bf16 param, fp16 grad
    assert lib.paddle_adamw_cuda(4, 7, 7, *hyper, *pointers) == CUDA_ERROR_INVALID_VALUE  # no such dtype
    assert lib.paddle_adamw_cuda(0, 2, 2, *hyper, *pointers) == 0  # nothing to update, nothing launched
    assert lib.paddle_squared_l2_norm_cuda(4, 7, null, null, null, null) == CUDA_ERROR_INVALID_VALUE
    assert lib.paddle_squared_l2_norm_workspace_bytes() == 1024 * ctypes.sizeof(ctypes.c_float)
