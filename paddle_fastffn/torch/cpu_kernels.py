"""The harness on the CPU, for the GPU benchmarks' CPU smoke (tests/torch_cpu): the same composition
(paddle_fastffn/core over backend.py) with the C API's CPU kernels where csrc/kernels has them
and a torch emulation of the FP8 kernels' contract where it has none.

    from paddle_fastffn.torch import cpu_kernels
    cpu_kernels.select()   # c_api.kernels() and fp8_c_api.kernels() now run on CPU tensors

select() is a harness-level switch: it points the harness's kernel singletons at the CPU variants
below and the FP8 state backend's device at "cpu". Nothing on the GPU path changes: c_api.py and
fp8/c_api.py are as they were, and a process that never calls select() never builds or loads this
library.

CpuKernels is c_api.Kernels over a library of the CPU kernels (build(): the host compiler, the
sources and flags of paddle_fastffn/ops/build_definition.py, as the Paddle CPU build compiles them).
The CPU entry points take the CUDA ones' argument structs without the stream, so Kernels' methods
run unchanged over _CpuEntryPoints, which maps fastffn_X_cuda(..., stream) to fastffn_X_cpu(...);
only the RMSNorm backward (the CPU kernel allocates its own workspace) is its own.

CpuFp8Kernels is fp8_c_api.Fp8Kernels' interface in torch ops, with the kernels' contract
(scaled_tensor.h; tests/gpu/test_fp8_kernels.py's quantize_ref and paddle_fastffn/fp8's Paddle
emulation are the same rules): quantisation is the fp32 product x * scale, saturated to the
format's max, rounded to nearest even, NaN -> 0x7F, Inf kept in e5m2 and NaN in e4m3; amax is
max |x| max-accumulated, NaN kept; the GEMM accumulates in fp32 (the 16-bit GEMMs too, as the
cuBLASLt provider does); scales are fmt_max * 2^-margin / amax, the previous scale where amax is 0
or not finite.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
from pathlib import Path

import torch

from paddle_fastffn.core.fp8.recipe import FP32_MAX, scale_numerator
from paddle_fastffn.torch import c_api
from paddle_fastffn.torch.build import REPO, definition
from paddle_fastffn.torch.c_structs import AdamwArgs, AdamwState, RmsNormArgs, check_abi
from paddle_fastffn.torch.fp8 import c_api as fp8_c_api
from paddle_fastffn.torch.fp8 import backend as torch_fp8_backend


def build(out_dir: Path | None = None) -> Path:
    """Compiles the CPU kernels and their host code into fastffn_cpu_kernels_<hash>.so with the
    host compiler, cached by the build definition's hash of the sources and flags."""
    out_dir = out_dir or Path(os.environ.get("FASTFFN_CPU_BUILD", REPO / "build" / "cpu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = definition.source_digest()[:12]
    library = out_dir / f"fastffn_cpu_kernels_{tag}.so"
    if library.exists():
        return library

    def compile_one(source: Path) -> Path:
        obj = out_dir / f"{source.name}.{tag}.o"
        c_api._run(definition.cxx_compile_command(source, obj))
        return obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, definition.cpu_harness_sources()))
    partial = library.with_suffix(f".{os.getpid()}.tmp")  # a concurrent build never sees half a file
    c_api._run(definition.cxx_link_command(objects, partial))
    partial.replace(library)
    return library


class _CpuEntryPoints:
    """The CPU library seen through the CUDA entry points' names: fastffn_X_cuda(..., stream) calls
    fastffn_X_cpu(...) (same argument structs, no stream); every other name is the library's own."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def __getattr__(self, name):
        if name.endswith("_cuda"):
            cpu = getattr(self._lib, name[:-len("_cuda")] + "_cpu")

            def call(*args):
                return cpu(*args[:-1])  # the stream
            call.__name__ = name
            return call
        return getattr(self._lib, name)


class CpuKernels(c_api.Kernels):
    """c_api.Kernels on CPU tensors, over the C API's CPU kernels."""

    def __init__(self, library: Path | None = None):
        lib = ctypes.CDLL(str(library or build()))
        check_abi(lib)  # every ctypes mirror against the layouts the library was built with
        lib.fastffn_status_string.restype = ctypes.c_char_p
        lib.fastffn_last_error.restype = ctypes.c_char_p
        ptr = ctypes.c_void_p
        for entry_point in c_api.ENTRY_POINTS.values():
            getattr(lib, f"{entry_point}_cpu").restype = ctypes.c_int  # a fastffn_status
        lib.fastffn_adamw_cpu.argtypes = [AdamwArgs, ptr, ptr, ptr, ptr, ptr]
        lib.fastffn_adamw_with_state_cpu.argtypes = [AdamwArgs, ptr, ptr, AdamwState]
        lib.fastffn_adamw_update_pows_cpu.argtypes = [ctypes.c_float, ctypes.c_float, ptr, ptr]
        self.cpu_lib = lib
        self.lib = _CpuEntryPoints(lib)

    @staticmethod
    def _stream():
        return None  # dropped by _CpuEntryPoints

    def rms_norm_bwd(self, x, weight, rstd, d_out, eps, d_sum=None):
        rows, cols = x.numel() // x.shape[-1], x.shape[-1]
        args = RmsNormArgs(rows, cols, eps, c_api._DTYPES[x.dtype])
        d_x = self.empty(x.shape, x.dtype, x.device)
        d_w = self.empty(weight.shape, weight.dtype, weight.device)
        self._check(self.cpu_lib.fastffn_rms_norm_bwd_cpu(
            args, self._ptr(x), self._ptr(weight), self._ptr(rstd), self._ptr(d_out), self._ptr(d_sum),
            self._ptr(d_x), self._ptr(d_w)), "rms_norm_bwd")
        return d_x, d_w


# --- FP8: the kernels' contract in torch ops --------------------------------------------------------

def _codes(x32: torch.Tensor, scale: torch.Tensor | None, fmt: torch.dtype) -> torch.Tensor:
    """The FP8 tensor the quantising kernels write for fp32 x (scaled_tensor.h's rules)."""
    y = x32 * scale if scale is not None else x32
    limit = fp8_c_api.FP8_MAX[fmt]
    codes = y.clamp(-limit, limit).to(fmt).view(torch.uint8).clone()
    codes[torch.isnan(y)] = fp8_c_api.FP8_NAN_BYTE
    inf = torch.isinf(x32)
    if fmt is torch.float8_e5m2:
        codes[inf & (x32 > 0)] = 0x7C
        codes[inf & (x32 < 0)] = 0xFC
    else:
        codes[inf] = fp8_c_api.FP8_NAN_BYTE
    return codes.view(fmt)


def _max_into(slot: torch.Tensor | None, x32: torch.Tensor) -> None:
    """slot[0] = max(slot[0], max |x|), NaN from either side kept."""
    if slot is None:
        return
    amax = x32.abs().max().reshape(1) if x32.numel() else torch.zeros(1, device=x32.device)
    if torch.isnan(x32).any():
        amax = torch.full_like(amax, float("nan"))
    slot[:1] = torch.where(torch.isnan(slot[:1]) | torch.isnan(amax), torch.full_like(amax, float("nan")),
                           torch.maximum(slot[:1], amax))


def _scale_inv(scale: torch.Tensor | None, device) -> torch.Tensor:
    one = torch.ones(1, dtype=torch.float32, device=device)
    return one if scale is None else one / scale.reshape(1)


def _write(data: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    if into is None:
        return data.contiguous()
    into.copy_(data)
    return into


def _quantized(x32, fmt, scale, rowwise, transpose, amax, out=None, out_t=None) -> fp8_c_api.Quantized:
    _max_into(amax, x32)
    codes = _codes(x32, scale, fmt) if rowwise or transpose or out is not None or out_t is not None else None
    data = _write(codes, out) if (rowwise or out is not None) else None
    data_t = _write(codes.t(), out_t) if (transpose or out_t is not None) else None
    scale_inv = _scale_inv(scale, x32.device) if codes is not None else None
    return fp8_c_api.Quantized(data, data_t, scale, scale_inv, amax)


def _float32(t: torch.Tensor, scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    x = t.float()
    return x * scale_inv.reshape(1) if scale_inv is not None else x


def _swiglu32(gate_up32: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up32.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


class CpuFp8Kernels:
    """fp8_c_api.Fp8Kernels' methods (the ones the composition calls) on CPU tensors."""

    def quantize(self, x, fp8, scale=None, rowwise=True, transpose=True, amax=None, out=None, out_t=None):
        amax = torch.zeros(1, dtype=torch.float32, device=x.device) if amax is None else amax
        return _quantized(x.float(), fp8, scale, rowwise, transpose, amax, out, out_t)

    def transpose(self, data, out_t=None):
        """An FP8 copy's other layout, the same bytes."""
        if out_t is None:
            return data.t().contiguous()
        out_t.copy_(data.t())
        return out_t

    def dequantize(self, q, scale_inv, dtype=torch.float32):
        return _float32(q, scale_inv).to(dtype)

    # GEMM tuning chooses among cuBLASLt's algorithms; the CPU GEMM has one. Off (0) is accepted.
    gemm_tuning = property(lambda self: 0)

    @gemm_tuning.setter
    def gemm_tuning(self, candidates):
        if int(candidates) > 1:
            raise NotImplementedError("GEMM tuning times cuBLASLt's candidate algorithms: the CUDA GEMM "
                                      "provider's alone (fastffn_gemm_set_tuning)")

    def gemm_tuning_records(self):
        return []

    def gemm(self, a, b, out_dtype=torch.bfloat16, a_scale_inv=None, b_scale_inv=None, transpose_a=False,
             transpose_b=False, alpha=1.0, fast_accum=False, out=None, accumulate=False):
        """D[M, N] = alpha * A @ B^T (+ out when accumulate), fp32 accumulation."""
        a32 = _float32(a.t() if transpose_a else a, a_scale_inv)
        b32 = _float32(b.t() if transpose_b else b, b_scale_inv)
        d = (a32 @ b32.t()) * alpha
        if out is None:
            assert not accumulate, "accumulate needs `out`"
            return d.to(out_dtype)
        out.copy_(out.float() + d if accumulate else d)
        return out

    def gemm_q(self, a, b, out_dtype=torch.bfloat16, a_t=False, b_t=False, **kw):
        return self.gemm(a.data_t if a_t else a.data, b.data_t if b_t else b.data, out_dtype,
                         a_scale_inv=a.scale_inv, b_scale_inv=b.scale_inv, **kw)

    def swiglu_fwd_fp8(self, gate_up, fp8, scale=None, rowwise=True, transpose=False, amax=None, track_amax=True,
                       out=None, out_t=None):
        return self.swiglu_fwd_fp8_with_gate_up(gate_up, fp8, scale, rowwise, transpose, amax, track_amax, out,
                                                out_t)[0]

    def swiglu_fwd_fp8_with_gate_up(self, gate_up, fp8, scale=None, rowwise=True, transpose=False, amax=None,
                                    track_amax=True, out=None, out_t=None, gate_up_scale=None,
                                    gate_up_rowwise=False, gate_up_amax=None):
        amax = fp8_c_api.Fp8Kernels._fresh_amax(amax, track_amax, gate_up.device)
        gate_up32 = gate_up.float()
        h = _quantized(_swiglu32(gate_up32), fp8, scale, rowwise, transpose, amax, out, out_t)
        q_gate_up = None
        if gate_up_rowwise or gate_up_amax is not None:
            q_gate_up = _quantized(gate_up32, fp8, gate_up_scale, gate_up_rowwise, False, gate_up_amax)
        return h, q_gate_up

    def swiglu_bwd_fp8(self, gate_up, d_h, fp8=torch.float8_e5m2, scale=None, rowwise=True, transpose=True,
                       amax=None, track_amax=True, h=None, h_scale=None, h_rowwise=False, h_transpose=True,
                       h_amax=None, gate_up_scale_inv=None):
        amax = fp8_c_api.Fp8Kernels._fresh_amax(amax, track_amax, gate_up.device)
        gate, up = _float32(gate_up, gate_up_scale_inv).chunk(2, dim=-1)
        d_h32 = d_h.float()
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate_up = torch.cat([d_h32 * up * sig * (1 + gate * (1 - sig)), d_h32 * silu], dim=-1)
        q_d_gate_up = _quantized(d_gate_up, fp8, scale, rowwise, transpose, amax)
        h_out = None
        if h in fp8_c_api.FP8_DTYPES:
            h_out = _quantized(silu * up, h, h_scale, h_rowwise, h_transpose, h_amax)
        elif h is not None:
            h_out = (silu * up).to(h)
        return q_d_gate_up, h_out

    @staticmethod
    def _set_scale(amax, scale, scale_inv, fmt_max, margin):
        amax = amax.float().reshape(1)
        usable = torch.isfinite(amax) & (amax > 0)
        numerator = torch.full((1,), scale_numerator(fmt_max, margin), dtype=torch.float32, device=amax.device)
        new = torch.where(usable, (numerator / torch.where(usable, amax, torch.ones_like(amax))).clamp(max=FP32_MAX),
                          scale.reshape(1))
        scale.copy_(new.reshape(scale.shape))
        if scale_inv is not None:
            scale_inv.copy_((1.0 / new).reshape(scale_inv.shape))

    def compute_scale(self, amax, scale, scale_inv, fmt_max, margin=0.0):
        self._set_scale(amax[:1], scale, scale_inv, fmt_max, margin)

    def update_amax_history(self, history, scale, scale_inv, fmt_max, margin=0.0, most_recent=False):
        """The scale from max(history) (NaN entries skipped, as TE's fmaxf) or history[0], then the
        history rolls: [0, history[2:], history[0]]."""
        amax = history[:1] if most_recent else torch.nan_to_num(history, nan=0.0, posinf=float("inf")).max()
        self._set_scale(amax, scale, scale_inv, fmt_max, margin)
        rolled = torch.cat([torch.zeros(1, dtype=history.dtype), history[2:], history[:1]]) \
            if history.numel() > 1 else torch.zeros(1, dtype=history.dtype)
        history.copy_(rolled)


def select() -> None:
    """Runs the harness on the CPU from now on in this process: c_api.kernels() is CpuKernels,
    fp8_c_api.kernels() CpuFp8Kernels, and the FP8 scaling states are made on the CPU."""
    c_api._KERNELS = CpuKernels()
    fp8_c_api._KERNELS = CpuFp8Kernels()
    torch_fp8_backend.TORCH.device = "cpu"

