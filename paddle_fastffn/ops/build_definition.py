"""The one build definition of the operator library: sources, include paths, flags, GPU
architectures and link libraries.

Pure Python with no Paddle or torch import, so that the three builders read the same lists:
``ops/_loader.py`` (Paddle's ``cpp_extension.load``, CPU and GPU), the standalone GPU harness
(``paddle_fastffn/torch/c_api.py``, nvcc on the H200 machine, which has no Paddle) and CI's build checks
(``tests/build_checks/``). The harness loads this file by path, so it needs no Paddle (the package's
``__init__`` imports it).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

LIBRARY_NAME = "paddle_fastffn_ops"

# GPU architectures every CUDA build targets: sm_80 (A100/A10/L40-class and newer through the
# driver's compatibility) and sm_90a (Hopper, with its Hopper-only instructions).
CUDA_ARCHS = ("80", "90a")


def gencode_flags() -> list[str]:
    """Explicit -gencode pairs: Paddle's CPU wheel ignores PADDLE_CUDA_ARCH_LIST, and a GPU wheel
    would otherwise query the build machine's GPU."""
    flags = []
    for arch in CUDA_ARCHS:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return flags


def host_simd_flags() -> list[str]:
    """AVX2/FMA/F16C when the building host has them (the library is built where it runs, and the
    flags are part of the cache key, so a shared cache never serves them to an older CPU)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= flags else []


# -fno-trapping-math: nothing enables FP traps in training, and without it GCC 12 refuses to
# if-convert the clamps of fast_expf, leaving the SwiGLU loops scalar (GCC's -fopt-info-vec shows
# it; on the 2-core dev machine SwiGLU fwd+bwd at 2048x11008 went from 611 ms to 174 ms).
# -fno-math-errno: nothing reads errno after a math call, and without it GCC keeps a branch to
# sqrtf (for errno on negative inputs) in the AdamW loop, leaving it scalar (-fopt-info-vec).
CXX_FLAGS = ["-O3", "-g0", "-std=c++17", "-fopenmp", "-fno-trapping-math", "-fno-math-errno",
             "-Wno-unused-function"] + host_simd_flags()
LD_FLAGS = ["-fopenmp"]  # the harness's link (libgomp); the Paddle build links paddle_openmp_link_flags()
CUDA_FLAGS = ["-O3", "-std=c++17", "--use_fast_math", *gencode_flags()]
# Tuning knob of csrc/kernels/cuda/rotary.cu (-DFASTFFN_ROTARY_HEADS_PER_THREAD=N; the default build
# sets none, which is 1): the values offered, each compiled without spills by CI
# (tests/build_checks), checked by tests/gpu and timed by bench_gpu.py's rope_sweep section.
ROTARY_HEADS_PER_THREAD = (1, 2, 4, 8)
# Libraries the CUDA kernels link against, beyond the CUDA runtime.
CUDA_LIBRARIES: list[str] = ["-ldl"]  # gemm.cu dlopens cuBLASLt (in libc itself from glibc 2.34)

# What paddle.utils.cpp_extension puts around CUDA_FLAGS for every .cu file it compiles
# (extension_utils.prepare_unix_cudaflags, Paddle 3.3.1). The harness compiles with the same
# prefix so the GPU tests run the code Paddle loads; tests/build_checks checks the list still matches the
# installed Paddle. Paddle also defines PADDLE_WITH_CUDA for the .cc bindings of a CUDA build.
PADDLE_NVCC_PREFIX = ["-DPADDLE_WITH_CUDA", "-DEIGEN_USE_GPU", "-ccbin", "cc", "-Xcompiler", "-fPIC",
                      "--expt-relaxed-constexpr", "-DNVCC"]
PADDLE_CXX_DEFINES = ["-D_GLIBCXX_USE_CXX11_ABI=1"]


def paddle_openmp_link_flags(paddle_libs: Path) -> list[str]:
    """Link the CPU kernels against the OpenMP runtime Paddle itself uses, so that one thread pool
    serves Paddle's kernels and ours.

    Paddle's x86 wheels (3.3.1) ship Intel's libiomp5 in paddle/libs, and libpaddle, libphi_core,
    libdnnl and MKL bind their GOMP_*/omp_* calls to it (LD_DEBUG=bindings). Linked with plain
    -fopenmp, our kernels bind to the system libgomp instead: a second pool whose workers spin
    (GOMP_SPINCOUNT) while Paddle's iomp5 workers spin for KMP_BLOCKTIME (200 ms) after each of its
    regions, each set stealing cores from the other between the many small kernels of a step. It
    also ignores Paddle's thread count: Paddle sets OMP_NUM_THREADS=1 when unset, after libgomp has
    already read the environment (libgomp: 2 threads, iomp5: 1 on the 2-core machine).
    Measured (benchmarks/cpu/bench_lengths.py, 2-core dev machine, OMP_NUM_THREADS=2, demo-size
    model, batches of 4 padded, stock and fast alternated, median of 5; the machine was shared):
    a libgomp build trained 24 GSM8K-length examples in 15.7 s vs stock's 11.8 s (0.75x); this
    build, right after, 9.3 s vs 11.2 s (1.21x) and 12 oasst1-zh-length examples 33.8 s vs 40.6 s
    (1.20x). Files: benchmarks/results/cpu_lengths_before_libgomp.json and cpu_lengths_after_2t.json
    at commit 8c5140e.
    libiomp5 implements GCC's GOMP_* entry points, so -fopenmp code runs on it unchanged. Wheels
    without libiomp5 (OpenBLAS builds) use libgomp themselves: plain -fopenmp is theirs."""
    if (Path(paddle_libs) / "libiomp5.so").is_file():
        return [f"-L{paddle_libs}", "-Wl,--no-as-needed", "-liomp5", "-Wl,--as-needed"]
    return ["-fopenmp"]


def csrc_root() -> Path:
    """The C++/CUDA sources: the checkout's csrc/ (editable install) or the copy a wheel carries
    as package data (paddle_fastffn/_csrc, see setup.py)."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "csrc", here.parents[1] / "_csrc"):
        if (candidate / "kernels" / "include" / "fastffn" / "c_api.h").exists():
            return candidate
    raise FileNotFoundError(
        "paddle_fastffn cannot find its C++ sources: neither the checkout's csrc/ nor the packaged "
        "paddle_fastffn/_csrc exists. Reinstall with `pip install .` (or a wheel from `pip wheel .`), "
        "or `pip install -e .` from a checkout.")


def include_dirs() -> list[Path]:
    return [csrc_root() / "kernels" / "include"]


def cuda_home() -> Path:
    return Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))


def cuda_include_dirs() -> list[Path]:
    """The toolkit's headers for host code that includes CUDA headers (the Paddle bindings of a
    CUDA build): include/ and, from CUDA 13 on, include/cccl (thrust, which Paddle's headers use)."""
    base = cuda_home() / "include"
    return [d for d in (base, base / "cccl") if d.is_dir()]


def cublas_include_dirs() -> list[Path]:
    """Where cublasLt.h is, for the GEMM provider (gemm.cu includes it for its types; cuBLASLt
    itself is loaded at run time). A full CUDA toolkit has it in include/; otherwise the headers
    packaged on PyPI: the folder scripts/fetch_cuda_headers.sh fills ($FASTFFN_CUDA_MATH_HEADERS),
    or the nvidia-cublas package beside this Python (torch and paddlepaddle-gpu install it)."""
    if (cuda_home() / "include" / "cublasLt.h").is_file():
        return []
    fetched = Path(os.environ.get("FASTFFN_CUDA_MATH_HEADERS",
                                  Path.home() / ".cache" / "paddle_fastffn" / "cuda_math_headers"))
    candidates = [fetched / "include"]
    for site in dict.fromkeys(p for p in sys.path if p.endswith("site-packages")):
        candidates += [Path(site) / "nvidia" / "cu13" / "include", Path(site) / "nvidia" / "cublas" / "include"]
    return [d for d in candidates if (d / "cublasLt.h").is_file()][:1]


def host_kernel_sources() -> list[Path]:
    """Host code of layer 1 that every build needs (status strings, launch planning)."""
    return sorted((csrc_root() / "kernels").glob("*.cc"))


def cpu_kernel_sources() -> list[Path]:
    return sorted((csrc_root() / "kernels" / "cpu").glob("*.cc"))


def cuda_kernel_sources() -> list[Path]:
    return sorted((csrc_root() / "kernels" / "cuda").glob("*.cu"))


def binding_sources() -> list[Path]:
    return sorted((csrc_root() / "paddle").glob("*.cc"))


def paddle_sources(cuda: bool) -> list[Path]:
    """What the loader hands to Paddle: the whole stack, CUDA kernels only for a CUDA Paddle."""
    sources = host_kernel_sources() + cpu_kernel_sources() + binding_sources()
    return sources + (cuda_kernel_sources() if cuda else [])


def harness_sources() -> list[Path]:
    """What the standalone GPU library holds: the CUDA kernels and the host code they call."""
    return host_kernel_sources() + cuda_kernel_sources()


def cpu_harness_sources() -> list[Path]:
    """What the harness's CPU library holds (the GPU benchmarks' CPU smoke, tests/torch_cpu): the
    CPU kernels and the host code they call, the sources the Paddle CPU build compiles."""
    return host_kernel_sources() + cpu_kernel_sources()


def source_digest(extra: list[str] = ()) -> str:
    """Hash of every C/C++/CUDA file under csrc/ plus the flags: the cache key of every build."""
    digest = hashlib.sha256()
    root = csrc_root()
    for path in sorted(root.rglob("*")):
        if path.suffix in {".h", ".cc", ".cu", ".cuh"}:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    for part in (CXX_FLAGS, LD_FLAGS, CUDA_FLAGS, CUDA_LIBRARIES, PADDLE_NVCC_PREFIX, list(extra)):
        digest.update(" ".join(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def nvcc_compile_command(source: Path, output: Path, extra: list[str] = ()) -> list[str]:
    """nvcc for one .cu file exactly as Paddle's cpp_extension compiles it for the loader."""
    includes = [f"-I{d}" for d in include_dirs() + cublas_include_dirs()]
    return ["nvcc", *PADDLE_NVCC_PREFIX, *CUDA_FLAGS, *includes, *extra, "-c", str(source),
            "-o", str(output)]


def cxx_compile_command(source: Path, output: Path, extra: list[str] = ()) -> list[str]:
    """The host compiler for one .cc file with the loader's flags (-fPIC for a shared library)."""
    includes = [f"-I{d}" for d in include_dirs()]
    cxx = os.environ.get("CXX", "c++")
    return [cxx, *CXX_FLAGS, *PADDLE_CXX_DEFINES, "-fPIC", *includes, *extra, "-c", str(source),
            "-o", str(output)]


def cxx_link_command(objects: list[Path], output: Path) -> list[str]:
    """Links the harness's CPU library with the host compiler (no CUDA toolkit needed)."""
    cxx = os.environ.get("CXX", "c++")
    return [cxx, "-shared", *map(str, objects), "-o", str(output), *LD_FLAGS]


def link_command(objects: list[Path], output: Path) -> list[str]:
    """Links the harness's shared library (the loader's link is Paddle's own)."""
    return ["nvcc", "-shared", *gencode_flags(), *map(str, objects), "-o", str(output),
            *[f"-Xcompiler={flag}" for flag in LD_FLAGS], *CUDA_LIBRARIES]
