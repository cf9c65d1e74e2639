"""Build and ctypes binding of benchmarks/gpu/paddle_adamw.cu (stock Paddle's AdamW kernel and its
global-norm clip's squared-norm reduction, ported as the optimizer baseline), without torch: the
GPU harness (paddle_adamw.py) loads it, and the CPU tests compile it with the same command."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from pathlib import Path

from paddle_fastffn.torch.build import REPO, definition

SOURCE = Path(__file__).resolve().with_name("paddle_adamw.cu")


def compile_command(output: Path, extra: list[str] = ()) -> list[str]:
    """nvcc for the baseline library: the build definition's architectures, -O3, no
    --use_fast_math (paddle_adamw.cu's header says why)."""
    return ["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared",
            *definition.gencode_flags(), *extra, str(SOURCE), "-o", str(output)]


def build(out_dir: Path | None = None) -> Path:
    """The compiled library, cached by a hash of the source and the command."""
    out_dir = Path(out_dir or os.environ.get("FASTFFN_GPU_BUILD", REPO / "build" / "gpu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(compile_command(Path("x"))).encode()).hexdigest()
    library = out_dir / f"paddle_adamw_{digest[:12]}.so"
    if not library.exists():
        result = subprocess.run(compile_command(library), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{result.stderr}")
    return library


def load(library: Path | None = None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library or build()))
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.paddle_adamw_cuda.restype = ctypes.c_int
    lib.paddle_adamw_cuda.argtypes = [i64, ctypes.c_int, ctypes.c_int, f32, f32, f32, f32, f32, ctypes.c_int,
                                      f32, f32, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.paddle_squared_l2_norm_workspace_bytes.restype = i64
    lib.paddle_squared_l2_norm_workspace_bytes.argtypes = []
    lib.paddle_squared_l2_norm_cuda.restype = ctypes.c_int
    lib.paddle_squared_l2_norm_cuda.argtypes = [i64, ctypes.c_int, ptr, ptr, ptr, ptr]
    return lib


def check(status: int, op: str):
    """The entry points return a cudaError_t."""
    if status != 0:
        raise RuntimeError(f"{op}: cudaError_t {status}")
