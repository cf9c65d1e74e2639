"""Helpers of the build checks: tools that CI must have, and commands that must succeed."""

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest


IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"`{name}` is not on PATH"
        if IN_CI:
            pytest.fail(f"{message}: CI must compile the CUDA code", pytrace=False)
        pytest.skip(message)
    return path


def cuda_math_headers() -> str:
    """Headers of cuBLAS/cuDNN/cuRAND/cuSPARSE/cuSOLVER/cuFFT, which Paddle's headers include under
    PADDLE_WITH_CUDA; scripts/fetch_cuda_headers.sh extracts them from their PyPI wheels."""
    folder = os.environ.get("FASTFFN_CUDA_MATH_HEADERS",
                            os.path.expanduser("~/.cache/paddle_fastffn/cuda_math_headers"))
    if not os.path.exists(os.path.join(folder, "COMPLETE")):
        message = f"no CUDA math-library headers in {folder} (run scripts/fetch_cuda_headers.sh)"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return os.path.join(folder, "include")


def require_cublaslt_header() -> None:
    """gemm.cu includes cublasLt.h, which a compiler-only CUDA toolkit lacks: it then comes from the
    folder scripts/fetch_cuda_headers.sh fills (scripts/test.sh runs it) or an nvidia-cublas wheel."""
    from paddle_fastffn.ops import build_definition

    if (build_definition.cuda_home() / "include" / "cublasLt.h").is_file() or build_definition.cublas_include_dirs():
        return
    message = "no cublasLt.h in the CUDA toolkit or a fetched header folder (run scripts/fetch_cuda_headers.sh)"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def run_all(commands) -> list[subprocess.CompletedProcess]:
    """run() of each command, as many at once as this process may use cores (each is a compiler
    process: threads only wait on them); results in the commands' order, the first failure (in that
    order) raised with run()'s message, and the compiles not yet started cancelled."""
    commands = list(commands)
    workers = max(1, min(len(commands), len(os.sched_getaffinity(0))))
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        return list(pool.map(run, commands))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
