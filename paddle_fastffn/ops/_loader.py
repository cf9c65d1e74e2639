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
from collections import Counter
from pathlib import Path

import paddle

from . import build_definition as definition
from .build_definition import LIBRARY_NAME

_lock = threading.Lock()
_registered = False
# How often each compiled op ran in this process: tests assert the kernels ran (a silent
# fallback to the *_ref path would leave these at zero).
CALL_COUNTS: Counter = Counter()
# When a list, each compiled-op call is appended to it in order (a test traces a layer's
# composition with it); None, the default, costs nothing.
CALL_LOG: list | None = None


class FastFFNBuildError(RuntimeError):
    """The custom operators could not be compiled; the message says what to install or fix."""


def csrc_root() -> Path:
    try:
        return definition.csrc_root()
    except FileNotFoundError as error:
        raise FastFFNBuildError(str(error)) from None


def with_cuda() -> bool:
    """Compile GPU code only where Paddle itself has CUDA: a CPU build never loads GPU code."""
    return paddle.is_compiled_with_cuda()


def _compiler_identity() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        raise FastFFNBuildError(
            f"paddle_fastffn compiles its operators on first import and needs a C++17 compiler, but "
            f"`{cxx}` is not on PATH. Install one (Debian/Ubuntu: `apt-get install g++`; conda: "
            f"`conda install gxx_linux-64`) or set CXX.")
    return subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def paddle_libs() -> Path:
    return Path(paddle.__file__).parent / "libs"


def openmp_link_flags() -> list[str]:
    """Paddle's own OpenMP runtime (build_definition.paddle_openmp_link_flags says why)."""
    return definition.paddle_openmp_link_flags(paddle_libs())


def openmp_runtime():
    """The OpenMP runtime the compiled ops call, as a ctypes library (omp_set_num_threads and
    omp_get_max_threads act on the pool the kernels share with Paddle): Paddle's libiomp5 where the
    wheel ships it, else libgomp."""
    import ctypes

    libiomp5 = paddle_libs() / "libiomp5.so"
    return ctypes.CDLL(str(libiomp5) if libiomp5.is_file() else "libgomp.so.1")


def cache_key(cuda: bool) -> str:
    csrc_root()  # a clear error when the sources are missing
    digest = hashlib.sha256(definition.source_digest(openmp_link_flags()).encode())
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
    csrc_root()
    try:
        load(name=LIBRARY_NAME, sources=[str(s) for s in definition.paddle_sources(cuda)],
             extra_cxx_cflags=definition.CXX_FLAGS,
             extra_cuda_cflags=definition.CUDA_FLAGS if cuda else None,
             extra_ldflags=openmp_link_flags() + (definition.CUDA_LIBRARIES if cuda else []),
             extra_include_paths=[str(d) for d in definition.include_dirs() + (
                 definition.cuda_include_dirs() + definition.cublas_include_dirs() if cuda else [])],
             build_directory=str(directory), verbose=bool(os.environ.get("PADDLE_FASTFFN_VERBOSE")))
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
    CALL_COUNTS[name] += 1
    if CALL_LOG is not None:
        CALL_LOG.append((name, args))
    outputs = paddle._C_ops._run_custom_op(name, *args)
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
