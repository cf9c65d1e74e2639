"""Builds the custom operators on first use and registers them with Paddle.

The shared library is cached under ``$PADDLE_FASTFFN_CACHE`` (default ``~/.cache/paddle_fastffn``)
in a folder keyed by a hash of the sources, the flags, the compiler and the Paddle build, so a
second import never recompiles and a Paddle upgrade never loads a stale library. A file lock makes
concurrent cold starts (every rank of ``paddle.distributed.launch`` imports at once) build once:
the first process builds, the others wait and then only register the library (milliseconds).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import paddle

LIBRARY_NAME = "paddle_fastffn_ops"


def _host_simd_flags() -> list[str]:
    """AVX2/FMA/F16C when the building host has them (the library is built where it runs, and
    the flags are part of the cache key, so a shared cache never serves them to an older CPU)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= flags else []


# -fno-trapping-math: nothing enables FP traps in training, and without it GCC 12 refuses to
# if-convert the clamps of fast_expf, leaving the SwiGLU loops scalar (GCC's -fopt-info-vec shows
# it; on the 2-core dev machine SwiGLU fwd+bwd at 2048x11008 went from 611 ms to 174 ms).
_CXX_FLAGS = ["-O3", "-g0", "-std=c++17", "-fopenmp", "-fno-trapping-math",
              "-Wno-unused-function"] + _host_simd_flags()
_LD_FLAGS = ["-fopenmp"]
_CUDA_FLAGS = [
    "-O3", "-std=c++17", "--use_fast_math", "-gencode", "arch=compute_80,code=sm_80",
    "-gencode", "arch=compute_90a,code=sm_90a",
]

_lock = threading.Lock()
_registered = False


class FastFFNBuildError(RuntimeError):
    """The custom operators could not be compiled; the message says what to install or fix."""


def csrc_root() -> Path:
    """The C++/CUDA sources: the repository's csrc/ (editable install) or the packaged copy."""
    for candidate in (Path(__file__).resolve().parents[2] / "csrc",
                      Path(__file__).resolve().parents[1] / "_csrc"):
        if (candidate / "kernels" / "include" / "fastffn" / "c_api.h").exists():
            return candidate
    raise FastFFNBuildError(
        "paddle_fastffn cannot find its C++ sources (csrc/). Install it with "
        "`pip install --no-build-isolation -e .` from a checkout, or from a wheel built by `pip wheel`.")


def with_cuda() -> bool:
    """Compile GPU code only where Paddle itself has CUDA: a CPU build never loads GPU code."""
    return paddle.is_compiled_with_cuda()


def source_files(cuda: bool) -> list[Path]:
    root = csrc_root()
    sources = [root / "kernels" / "status.cc"]
    sources += sorted((root / "kernels" / "cpu").glob("*.cc")) + sorted((root / "paddle").glob("*.cc"))
    if cuda:
        sources += sorted((root / "kernels" / "cuda").glob("*.cu"))
    return sources


def _compiler_identity() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        raise FastFFNBuildError(
            f"paddle_fastffn compiles its operators on first import and needs a C++17 compiler, but "
            f"`{cxx}` is not on PATH. Install one (Debian/Ubuntu: `apt-get install g++`; conda: "
            f"`conda install gxx_linux-64`) or set CXX.")
    return subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def cache_key(cuda: bool) -> str:
    digest = hashlib.sha256()
    root = csrc_root()
    for path in sorted(root.rglob("*")):
        if path.suffix in {".h", ".cc", ".cu", ".cuh"}:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    for part in (_CXX_FLAGS, _LD_FLAGS, _CUDA_FLAGS if cuda else []):
        digest.update(" ".join(part).encode())
    digest.update(paddle.__version__.encode())
    digest.update(paddle.version.commit.encode())
    digest.update(_compiler_identity().encode())
    digest.update(b"cuda" if cuda else b"cpu")
    return digest.hexdigest()[:20]


def cache_dir(cuda: bool) -> Path:
    base = Path(os.environ.get("PADDLE_FASTFFN_CACHE", Path.home() / ".cache" / "paddle_fastffn"))
    return base / cache_key(cuda)


def _build(directory: Path, cuda: bool) -> None:
    from paddle.utils.cpp_extension import load

    if cuda and shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        raise FastFFNBuildError(
            "Paddle has CUDA, so paddle_fastffn compiles its CUDA kernels on first import, but nvcc "
            "is not found. Install the CUDA toolkit matching your Paddle build and set CUDA_HOME.")
    include = str(csrc_root() / "kernels" / "include")
    try:
        load(name=LIBRARY_NAME, sources=[str(s) for s in source_files(cuda)],
             extra_cxx_cflags=_CXX_FLAGS, extra_cuda_cflags=_CUDA_FLAGS if cuda else None,
             extra_ldflags=_LD_FLAGS, extra_include_paths=[include], build_directory=str(directory),
             verbose=bool(os.environ.get("PADDLE_FASTFFN_VERBOSE")))
    except Exception as error:  # Paddle reports a compile error as a generic link failure.
        raise FastFFNBuildError(
            f"paddle_fastffn failed to compile its operators in {directory}. The first compiler "
            f"error is the cause (the final link error is a consequence); rerun with "
            f"PADDLE_FASTFFN_VERBOSE=1 to see the full log.\n{error}") from error


def library_path() -> Path:
    return cache_dir(with_cuda()) / LIBRARY_NAME / f"{LIBRARY_NAME}.so"


def ensure_loaded() -> None:
    """Compiles (once per cache key, across processes) and registers the operators."""
    global _registered
    with _lock:
        if _registered:
            return
        cuda = with_cuda()
        directory = cache_dir(cuda)
        directory.mkdir(parents=True, exist_ok=True)
        marker = directory / "BUILD_OK"
        built_here = False
        with open(directory / ".lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                if not marker.exists():
                    _build(directory, cuda)  # also registers the ops in this process
                    marker.write_text(f"{LIBRARY_NAME}.so\n")
                    built_here = True
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
        if not built_here:
            from paddle.utils.cpp_extension.extension_utils import load_op_meta_info_and_register_op

            load_op_meta_info_and_register_op(str(library_path()))
        _registered = True


def run_op(name: str, *args):
    """Calls a registered custom op in dynamic mode; returns a list of output tensors."""
    ensure_loaded()
    outputs = paddle._C_ops._run_custom_op(name, *args)
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
