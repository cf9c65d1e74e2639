"""Standalone GPU harness: builds csrc/kernels (the same sources the Paddle CUDA bindings call)
with nvcc into a shared library and drives it through ctypes. PyTorch only allocates memory,
supplies the stream, runs the GEMMs and attention around our kernels, and computes references.

The compositions here (FFN, decoder layer) are the ones the Paddle fast path uses, with torch's
cuBLAS and SDPA standing in for Paddle's.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import subprocess
from pathlib import Path

import torch

from benchmarks.gpu.build_definition import REPO, definition
from benchmarks.gpu.optimizer_ctypes import AdamwArgs, Scalar



# Tests set this: every output buffer starts as NaN, so an element a kernel fails to write shows.
POISON_OUTPUTS = False

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


class SwigluArgs(ctypes.Structure):
    _fields_ = [("gate", ctypes.c_void_p), ("up", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("cols", ctypes.c_int64), ("gate_row_stride", ctypes.c_int64),
                ("up_row_stride", ctypes.c_int64), ("dtype", ctypes.c_int)]


class RmsNormArgs(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("epsilon", ctypes.c_float),
                ("dtype", ctypes.c_int)]


class DeviceLimits(ctypes.Structure):
    _fields_ = [("sm_count", ctypes.c_int), ("max_shared_bytes_per_block", ctypes.c_int)]


class RmsNormBwdPlan(ctypes.Structure):
    _fields_ = [("blocks", ctypes.c_int64), ("shared_bytes", ctypes.c_int64),
                ("shared_partials", ctypes.c_int), ("workspace_bytes", ctypes.c_int64)]


class RotaryArgs(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("seq", ctypes.c_int64), ("q_heads", ctypes.c_int64),
                ("k_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("q_token_stride", ctypes.c_int64), ("k_token_stride", ctypes.c_int64),
                ("q_out_token_stride", ctypes.c_int64), ("k_out_token_stride", ctypes.c_int64),
                ("table_rows", ctypes.c_int64), ("inverse", ctypes.c_int), ("dtype", ctypes.c_int),
                ("position_error", ctypes.c_void_p)]


def scalar(value) -> Scalar:
    """A Python number as a host value, a one-element fp32 CUDA tensor as its device address (the
    kernel reads it when it runs: no host sync, and a CUDA graph replays the current value), a
    one-element fp32 CPU tensor (the beta powers, which Paddle keeps on the host) as its value."""
    if isinstance(value, torch.Tensor):
        assert value.dtype == torch.float32 and value.numel() == 1 and value.is_contiguous(), value
        if value.is_cuda:
            return Scalar(0.0, value.data_ptr())
        assert value.device.type == "cpu", value
        return Scalar(ctypes.c_float.from_address(value.data_ptr()).value, None)  # host memory: no torch op
    return Scalar(float(value), None)


def _run(cmd: list[str]) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"build failed: {' '.join(cmd)}\n{result.stderr}")
    return result.stderr


def build(out_dir: Path | None = None, verbose: bool = False, defines: tuple[str, ...] = ()) -> Path:
    """Compiles the CUDA kernels and their host code into fastffn_kernels_<hash>.so with the build
    definition the Paddle loader uses (same sources, nvcc flags, architectures, libraries), cached
    by a hash of all of them. `verbose` prints ptxas's register/spill report; `defines`
    ("NAME=VALUE") are for tuning sweeps only."""
    extra = [f"-D{d}" for d in defines]
    out_dir = out_dir or Path(os.environ.get("FASTFFN_GPU_BUILD", REPO / "build" / "gpu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / f"fastffn_kernels_{definition.source_digest(extra)[:12]}.so"  # cache key
    if library.exists():
        return library
    tag = definition.source_digest(extra)[:12]

    def compile_one(source: Path) -> tuple[Path, str]:
        obj = out_dir / f"{source.name}.{tag}.o"
        if source.suffix == ".cu":
            return obj, _run(definition.nvcc_compile_command(
                source, obj, extra + (["-Xptxas=-v"] if verbose else [])))
        return obj, _run(definition.cxx_compile_command(source, obj, extra))

    # One compiler process per file, in parallel: the files are independent.
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        compiled = list(pool.map(compile_one, definition.harness_sources()))
    objects, report = [obj for obj, _ in compiled], [text for _, text in compiled]
    _run(definition.link_command(objects, library))
    if verbose:
        print("".join(report))
    return library


class Kernels:
    """ctypes view of the C API; every call checks the returned status."""

    def __init__(self, library: Path | None = None):
        self.lib = ctypes.CDLL(str(library or build()))
        self.lib.fastffn_status_string.restype = ctypes.c_char_p
        self.lib.fastffn_rms_norm_bwd_workspace_bytes_cuda.restype = ctypes.c_int64
        self.lib.fastffn_rms_norm_bwd_workspace_bytes_cuda.argtypes = [RmsNormArgs]
        self.lib.fastffn_plan_rms_norm_bwd.restype = RmsNormBwdPlan
        self.lib.fastffn_plan_rms_norm_bwd.argtypes = [ctypes.c_int64, ctypes.c_int64, DeviceLimits]
        for name in ("fastffn_device_limits_cuda", "fastffn_swiglu_fwd_cuda", "fastffn_swiglu_bwd_cuda", "fastffn_rms_norm_fwd_cuda",
                     "fastffn_rms_norm_bwd_cuda", "fastffn_rotary_cuda"):
            getattr(self.lib, name).restype = ctypes.c_int
        ptr = ctypes.c_void_p
        self.lib.fastffn_adamw_cuda.restype = ctypes.c_int
        self.lib.fastffn_adamw_cuda.argtypes = [AdamwArgs, ptr, ptr, ptr, ptr, ptr, ptr]
        self.lib.fastffn_adamw_update_pows_cuda.restype = ctypes.c_int
        self.lib.fastffn_adamw_update_pows_cuda.argtypes = [ctypes.c_float, ctypes.c_float, ptr, ptr, ptr]

    def _check(self, status: int, op: str):
        if status != 0:
            raise RuntimeError(f"{op}: {self.lib.fastffn_status_string(status).decode()}")

    @staticmethod
    def _stream():
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    @staticmethod
    def _ptr(t):
        return ctypes.c_void_p(t.data_ptr()) if t is not None else ctypes.c_void_p(0)

    @staticmethod
    def empty(shape, dtype, device):
        if POISON_OUTPUTS:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)

    # --- SwiGLU -----------------------------------------------------------------------------
    def _swiglu_args(self, gate_up, up=None):
        rows = gate_up.numel() // gate_up.shape[-1]
        if up is None:
            cols = gate_up.shape[-1] // 2
            base = gate_up.data_ptr()
            return SwigluArgs(base, base + cols * gate_up.element_size(), rows, cols, 2 * cols,
                              2 * cols, _DTYPES[gate_up.dtype])
        cols = gate_up.shape[-1]
        return SwigluArgs(gate_up.data_ptr(), up.data_ptr(), rows, cols, cols, cols,
                          _DTYPES[gate_up.dtype])

    def swiglu_fwd(self, gate_up, up=None):
        args = self._swiglu_args(gate_up, up)
        out = self.empty((*gate_up.shape[:-1], args.cols), gate_up.dtype, gate_up.device)
        self._check(self.lib.fastffn_swiglu_fwd_cuda(args, self._ptr(out), ctypes.c_int64(args.cols),
                                                     self._stream()), "swiglu_fwd")
        return out

    def swiglu_bwd(self, gate_up, d_out, up=None, recompute=False, in_place=False):
        """Returns (d_gate_up or (d_gate, d_up), recomputed output or None). With in_place the
        gradient overwrites gate_up (and the recomputed output overwrites d_out)."""
        args = self._swiglu_args(gate_up, up)
        cols, esize = args.cols, gate_up.element_size()
        if up is None:
            d_x = gate_up if in_place else self.empty(gate_up.shape, gate_up.dtype, gate_up.device)
            d_gate, d_up, d_stride = d_x.data_ptr(), d_x.data_ptr() + cols * esize, 2 * cols
        else:
            d_x = gate_up if in_place else self.empty(gate_up.shape, gate_up.dtype, gate_up.device)
            d_y = up if in_place else self.empty(up.shape, up.dtype, up.device)
            d_gate, d_up, d_stride = d_x.data_ptr(), d_y.data_ptr(), cols
        hidden = None
        if recompute:
            hidden = d_out if in_place else self.empty(d_out.shape, d_out.dtype, d_out.device)
        status = self.lib.fastffn_swiglu_bwd_cuda(
            args, self._ptr(d_out), ctypes.c_int64(cols), ctypes.c_void_p(d_gate),
            ctypes.c_int64(d_stride), ctypes.c_void_p(d_up), ctypes.c_int64(d_stride),
            self._ptr(hidden), ctypes.c_int64(cols), self._stream())
        self._check(status, "swiglu_bwd")
        return (d_x if up is None else (d_x, d_y)), hidden

    # --- RMSNorm ----------------------------------------------------------------------------
    def rms_norm_fwd(self, x, weight, eps, residual=None):
        rows, cols = x.numel() // x.shape[-1], x.shape[-1]
        args = RmsNormArgs(rows, cols, eps, _DTYPES[x.dtype])
        out = self.empty(x.shape, x.dtype, x.device)
        total = self.empty(x.shape, x.dtype, x.device) if residual is not None else None
        rstd = self.empty((rows,), torch.float32, x.device)
        self._check(self.lib.fastffn_rms_norm_fwd_cuda(
            args, self._ptr(x), self._ptr(residual), self._ptr(weight), self._ptr(out),
            self._ptr(total), self._ptr(rstd), self._stream()), "rms_norm_fwd")
        return out, total, rstd

    def rms_norm_bwd(self, x, weight, rstd, d_out, eps, d_sum=None):
        rows, cols = x.numel() // x.shape[-1], x.shape[-1]
        args = RmsNormArgs(rows, cols, eps, _DTYPES[x.dtype])
        workspace_bytes = self.lib.fastffn_rms_norm_bwd_workspace_bytes_cuda(args)
        if workspace_bytes < 0:
            raise RuntimeError("rms_norm_bwd: the current CUDA device's limits could not be read")
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=x.device)
        d_x = self.empty(x.shape, x.dtype, x.device)
        d_w = self.empty(weight.shape, weight.dtype, weight.device)
        self._check(self.lib.fastffn_rms_norm_bwd_cuda(
            args, self._ptr(x), self._ptr(weight), self._ptr(rstd), self._ptr(d_out),
            self._ptr(d_sum), self._ptr(d_x), self._ptr(d_w), self._ptr(workspace),
            self._stream()), "rms_norm_bwd")
        return d_x, d_w

    # --- Rotary -----------------------------------------------------------------------------
    def rotary(self, q, k, cos, sin, position_ids=None, inverse=False, q_out=None, k_out=None):
        """q [b, s, hq, d], k [b, s, hk, d] (token-strided views allowed); cos/sin fp32 [rows, d].
        q_out/k_out may be given as token-strided views (e.g. slices of a d_qkv buffer)."""
        b, s, hq, d = q.shape
        hk = k.shape[2]
        q_out = self.empty((b, s, hq, d), q.dtype, q.device) if q_out is None else q_out
        k_out = self.empty((b, s, hk, d), k.dtype, k.device) if k_out is None else k_out
        for t in (q, k, q_out, k_out):
            assert t.stride(3) == 1 and t.stride(2) == d and t.stride(0) == t.stride(1) * s
        # As the Paddle binding: the forward with position ids reads back the kernel's range flag.
        error = torch.zeros(1, dtype=torch.int32, device=q.device) if position_ids is not None and not inverse else None
        args = RotaryArgs(b, s, hq, hk, d, q.stride(1), k.stride(1), q_out.stride(1), k_out.stride(1),
                          cos.shape[0], int(inverse), _DTYPES[q.dtype], self._ptr(error))
        self._check(self.lib.fastffn_rotary_cuda(
            args, self._ptr(q), self._ptr(k), self._ptr(cos), self._ptr(sin), self._ptr(position_ids),
            self._ptr(q_out), self._ptr(k_out), self._stream()), "rotary")
        if error is not None and int(error.item()) != 0:
            raise ValueError(f"rotary: position_ids holds a position outside the cos/sin table [0, {cos.shape[0]})")
        return q_out, k_out

    # --- AdamW (fastffn/optimizer.h) ----------------------------------------------------------
    def adamw(self, param, grad, moment1, moment2, master=None, *, lr, beta1_pow, beta2_pow,
              beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, lr_ratio=1.0, with_decay=True,
              grad_scale=1.0):
        """One step of Paddle's AdamW on one tensor, in place: param (fp32/fp16/bf16), grad (its
        dtype or fp32), master (fp32 or None), moment1/moment2 (fp32), all with param's element
        count (contiguous; any alignment). lr, beta1_pow (beta1^t), beta2_pow and grad_scale: host
        numbers, one-element fp32 CUDA tensors (read by the kernel) or one-element fp32 CPU
        tensors (their values, see scalar)."""
        for t in (param, grad, moment1, moment2, master):
            assert t is None or (t.is_contiguous() and t.numel() == param.numel()), "adamw: tensor layout"
        args = AdamwArgs(param.numel(), _DTYPES[param.dtype], _DTYPES[grad.dtype], beta1, beta2, eps,
                         weight_decay, lr_ratio, int(with_decay), scalar(lr), scalar(beta1_pow),
                         scalar(beta2_pow), scalar(grad_scale))
        self._check(self.lib.fastffn_adamw_cuda(args, param.data_ptr(), grad.data_ptr(),
                                                master.data_ptr() if master is not None else None,
                                                moment1.data_ptr(), moment2.data_ptr(),
                                                self._stream()), "adamw")

    def adamw_update_pows(self, beta1, beta2, beta1_pow, beta2_pow):
        """beta1_pow *= beta1, beta2_pow *= beta2 on the device (fp32 one-element tensors)."""
        self._check(self.lib.fastffn_adamw_update_pows_cuda(beta1, beta2, beta1_pow.data_ptr(),
                                                            beta2_pow.data_ptr(), self._stream()),
                    "adamw_update_pows")


_KERNELS: Kernels | None = None


def kernels() -> Kernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = Kernels()
    return _KERNELS


def device_limits(device: int = 0) -> DeviceLimits:
    limits = DeviceLimits()
    kernels()._check(kernels().lib.fastffn_device_limits_cuda(device, ctypes.byref(limits)), "device_limits")
    return limits


def rms_norm_bwd_plan(rows: int, cols: int, limits: DeviceLimits) -> RmsNormBwdPlan:
    return kernels().lib.fastffn_plan_rms_norm_bwd(rows, cols, limits)


# --- autograd wrappers (what the Paddle PyLayers do, in torch) ---------------------------------

class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return kernels().swiglu_fwd(gate_up)

    @staticmethod
    def backward(ctx, d_out):
        (gate_up,) = ctx.saved_tensors
        return kernels().swiglu_bwd(gate_up, d_out.contiguous())[0]


class SwiGLUPair(torch.autograd.Function):
    """silu(gate) * up from two tensors (Paddle's ops.swiglu(x, y): the MLP with unfused gate_proj
    and up_proj, as under LoRA); gate and up kept for backward, which writes d_gate and d_up."""

    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return kernels().swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, d_out):
        gate, up = ctx.saved_tensors
        (d_gate, d_up), _ = kernels().swiglu_bwd(gate, d_out.contiguous(), up=up)
        return d_gate, d_up


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        out, _, rstd = kernels().rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, weight, rstd = ctx.saved_tensors
        d_x, d_w = kernels().rms_norm_bwd(x, weight, rstd, d_out.contiguous(), ctx.eps)
        return d_x, d_w, None


class AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        out, total, rstd = kernels().rms_norm_fwd(x, weight, eps, residual=residual)
        ctx.save_for_backward(total, weight, rstd)
        ctx.eps = eps
        return out, total

    @staticmethod
    def backward(ctx, d_out, d_total):
        total, weight, rstd = ctx.saved_tensors
        d_sum = None if d_total is None else d_total.contiguous()
        d_x, d_w = kernels().rms_norm_bwd(total, weight, rstd, d_out.contiguous(), ctx.eps, d_sum)
        return d_x, d_x, d_w, None


class Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids):
        ctx.save_for_backward(cos, sin, position_ids)
        return kernels().rotary(q, k, cos, sin, position_ids)

    @staticmethod
    def backward(ctx, d_q, d_k):
        cos, sin, position_ids = ctx.saved_tensors
        d_q, d_k = kernels().rotary(d_q.contiguous(), d_k.contiguous(), cos, sin, position_ids,
                                    inverse=True)
        return d_q, d_k, None, None, None


class QKVRotary(torch.autograd.Function):
    """Splits a fused QKV projection output [b, s, (hq + 2 hk) d] into rotated q, rotated k and v.
    The rotary kernel reads q and k straight from the strided slices; the backward writes d_q and
    d_k straight into one d_qkv buffer (no zero-fill, slice copies or gradient adds). v is a copy,
    as PaddleNLP's paddle.split gives it (Paddle 3.3 split copies): a view would keep the whole
    QKV output alive as long as attention keeps v for its backward (2/3 of it dead weight)."""

    @staticmethod
    def forward(ctx, qkv, heads, kv_heads, cos, sin, position_ids=None):
        """position_ids: None (positions 0..seq-1) or int64 [b, s] (packed rows: restarting per
        example), read by the kernel, which flags out-of-table positions as the Paddle binding."""
        b, s, width = qkv.shape
        d = width // (heads + 2 * kv_heads)
        q = qkv[..., : heads * d].view(b, s, heads, d)
        k = qkv[..., heads * d: (heads + kv_heads) * d].view(b, s, kv_heads, d)
        v = qkv[..., (heads + kv_heads) * d:].view(b, s, kv_heads, d).contiguous()
        q_rot, k_rot = kernels().rotary(q, k, cos, sin, position_ids)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.dims = (heads, kv_heads, d)
        return q_rot, k_rot, v

    @staticmethod
    def backward(ctx, d_q, d_k, d_v):
        cos, sin, position_ids = ctx.saved_tensors
        heads, kv_heads, d = ctx.dims
        b, s = d_q.shape[:2]
        d_qkv = torch.empty(b, s, (heads + 2 * kv_heads) * d, dtype=d_q.dtype, device=d_q.device)
        kernels().rotary(d_q.contiguous(), d_k.contiguous(), cos, sin, position_ids, inverse=True,
                         q_out=d_qkv[..., : heads * d].view(b, s, heads, d),
                         k_out=d_qkv[..., heads * d: (heads + kv_heads) * d].view(b, s, kv_heads, d))
        d_qkv[..., (heads + kv_heads) * d:].view(b, s, kv_heads, d).copy_(d_v)
        return d_qkv, None, None, None, None, None


class SwiGLUDownProj(torch.autograd.Function):
    """out = swiglu(gate_up) @ W_d^T: what the Paddle patch's MLP runs after its gate_up_fused_proj
    GEMM (ops.swiglu_down_proj with reuse_gate_up_memory). With recompute only gate_up is kept;
    the backward writes d_gate_up over it and the recomputed SwiGLU output over d_hidden."""

    @staticmethod
    def forward(ctx, gate_up, w_down, recompute=True):
        hidden = kernels().swiglu_fwd(gate_up)
        ctx.recompute = recompute
        ctx.save_for_backward(gate_up, w_down, None if recompute else hidden)
        return hidden @ w_down.t()

    @staticmethod
    def backward(ctx, d_out):
        gate_up, w_down, hidden = ctx.saved_tensors
        d_hidden = d_out @ w_down
        d_gate_up, recomputed = kernels().swiglu_bwd(gate_up, d_hidden, recompute=ctx.recompute, in_place=True)
        hidden = recomputed if ctx.recompute else hidden
        rows = hidden.numel() // hidden.shape[-1]
        d_w_down = d_out.reshape(rows, -1).t() @ hidden.reshape(rows, -1)
        return d_gate_up, d_w_down, None


class FusedFFN(torch.autograd.Function):
    """y = swiglu(x @ W_gu^T) @ W_d^T on PaddleNLP's fused gate_up weight (torch Linear layout
    here: W_gu [2I, H] = [W_gate; W_up], W_d [H, I]).

    split_gemms=False: one [T, 2I] GEMM (packed SwiGLU); True: two [T, I] GEMMs on the row halves
    of W_gu (free views) and the two-input SwiGLU (see fused_ffn for which is the default and why).
    With recompute the SwiGLU output is not stored: the backward kernel rewrites it in place over
    d_hidden. The gate/up gradients overwrite gate/up, and the SwiGLU output is released before
    the input-gradient GEMMs, so the backward's peak holds [T, 3I] activations, not [T, 6I]."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, recompute, split_gemms):
        x2 = x.reshape(-1, x.shape[-1])
        inter = w_down.shape[1]
        if split_gemms:
            gate, up = x2 @ w_gate_up[:inter].t(), x2 @ w_gate_up[inter:].t()
            hidden = kernels().swiglu_fwd(gate, up)
            saved = (gate, up)
        else:
            gate_up = x2 @ w_gate_up.t()
            hidden = kernels().swiglu_fwd(gate_up)
            saved = (gate_up, None)
        out = hidden @ w_down.t()
        ctx.recompute, ctx.split, ctx.x_shape = recompute, split_gemms, x.shape
        ctx.save_for_backward(x2, w_gate_up, w_down, *saved, None if recompute else hidden)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, d_out):
        x2, w_gate_up, w_down, first, up, hidden = ctx.saved_tensors
        inter = w_down.shape[1]
        d_out = d_out.reshape(-1, d_out.shape[-1])
        d_hidden = d_out @ w_down
        grads, recomputed = kernels().swiglu_bwd(first, d_hidden, up=up, recompute=ctx.recompute,
                                                 in_place=True)
        hidden = recomputed if ctx.recompute else hidden
        d_w_down = d_out.t() @ hidden
        del hidden, recomputed, d_hidden  # release [T, I] before the [T, H] / [2I, H] outputs
        if ctx.split:
            d_gate, d_up = grads
            d_x = d_gate @ w_gate_up[:inter]
            d_x.addmm_(d_up, w_gate_up[inter:])
            d_w_gate_up = torch.empty_like(w_gate_up)
            torch.mm(d_gate.t(), x2, out=d_w_gate_up[:inter])
            torch.mm(d_up.t(), x2, out=d_w_gate_up[inter:])
        else:
            d_x = grads @ w_gate_up
            d_w_gate_up = grads.t() @ x2
        return d_x.reshape(ctx.x_shape), d_w_gate_up, d_w_down, None, None


def fused_ffn(x, w_gate_up, w_down, recompute=True, split_gemms=False):
    """The FFN composition. split_gemms=False (one [T, 2I] GEMM) is the default because interleaved
    timing on the H200 (2026-12-02, run 3, gpu_h200_run3_sweep.json) found it faster or level at
    every shape, e.g. 7B: 2.55 vs 2.66 ms at 2048 tokens, 10.18 vs 10.39 ms at 8192. (A first,
    sequential run had suggested the split layout at small T; that was drift, see
    results/history/README.md.)"""
    return FusedFFN.apply(x, w_gate_up, w_down, recompute, split_gemms)


# --- fused linear cross-entropy (paddle_fastffn/ops/linear_cross_entropy.py's composition) ------

class CrossEntropyArgs(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("vocab", ctypes.c_int64), ("row_stride", ctypes.c_int64),
                ("ignore_index", ctypes.c_int64), ("grad_scale", ctypes.c_float), ("with_grad", ctypes.c_int),
                ("dtype", ctypes.c_int), ("label_error", ctypes.c_void_p)]


# One chunk's logits at most, counted in fp32 (chunk_tokens * vocab * 4 bytes): the Paddle op's GPU
# default (paddle_fastffn/ops/linear_cross_entropy.py says what it was measured against).
GPU_CHUNK_BYTES = 1 << 30


def _label_error(vocab, ignore_index) -> ValueError:
    return ValueError(f"cross_entropy: `labels` holds a label outside the vocabulary [0, {vocab}) that is "
                      f"not ignore_index ({ignore_index})")


def _raise_if_label_error(error, vocab, ignore_index):
    if int(error.item()) != 0:
        raise _label_error(vocab, ignore_index)


def cross_entropy(logits, labels, ignore_index=-100, grad_scale=1.0, with_grad=True, error=None):
    """The fused kernel in place on logits [rows, V] (fp32/fp16/bf16, unit column stride): returns
    the fp32 [rows] losses; with_grad, logits becomes (softmax - onehot) * grad_scale (0 on ignored
    rows and rows whose loss is not > 0). Labels (int64) outside [0, V) that are not ignore_index
    raise ValueError, read back from the kernel's device flag as the Paddle binding does; with
    `error` (a zeroed device int32 [1]) the flag is left there for the caller to read once."""
    k = kernels()
    k.lib.fastffn_cross_entropy_cuda.restype = ctypes.c_int
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and labels.dtype == torch.int64 and labels.is_contiguous()
    loss = k.empty((rows,), torch.float32, logits.device)
    flag = torch.zeros(1, dtype=torch.int32, device=logits.device) if error is None else error
    args = CrossEntropyArgs(rows, vocab, logits.stride(0) if rows > 1 else vocab, ignore_index, grad_scale,
                            int(with_grad), _DTYPES[logits.dtype], flag.data_ptr())
    k._check(k.lib.fastffn_cross_entropy_cuda(args, k._ptr(logits), k._ptr(labels), k._ptr(loss), k._stream()),
             "cross_entropy")
    if error is None:
        _raise_if_label_error(flag, vocab, ignore_index)
    return loss


def _read_back(pending, d_loss=None) -> float:
    """The Paddle op's _PendingReadback.read: one copy of (kept count, label flag, d_loss) to the
    host; raises for a flagged label; returns d_loss * n_labelled / n_kept (1 almost always)."""
    n_labelled, n_kept, error, vocab, ignore_index = pending
    parts = [n_kept.double().reshape(1), error.double().reshape(1)]
    if d_loss is not None:
        parts.append(d_loss.double().reshape(1))
    values = torch.cat(parts).tolist()
    if values[1] != 0:
        raise _label_error(vocab, ignore_index)
    kept = int(values[0])
    factor = n_labelled / kept if kept and kept != n_labelled else 1.0
    return (values[2] if d_loss is not None else 1.0) * factor


def _gemm_fp32_out(out, a, b, accumulate=False, alpha=1.0):
    """out (fp32) = alpha * a @ b (+ out): torch's cuBLAS with fp32 output for 16-bit inputs
    (torch.addmm's out_dtype), so d_weight sums every chunk in fp32 without rounding each chunk's
    product to bf16 first."""
    beta = 1.0 if accumulate else 0.0
    if a.dtype == torch.float32:
        return torch.addmm(out, a, b, beta=beta, alpha=alpha, out=out)
    return torch.addmm(out, a, b, out_dtype=torch.float32, beta=beta, alpha=alpha, out=out)


class LinearCrossEntropy(torch.autograd.Function):
    """PaddleNLP's LlamaPretrainingCriterion(hidden @ weight) in chunks of tokens (the Paddle op's
    composition, torch's cuBLAS for Paddle's matmul): per chunk the logits in the inputs' dtype
    (fp32 accumulation, as the stock LM head), the fused kernel in place, then
    d_hidden_chunk = d_logits @ W^T (in the inputs' dtype) and d_W += hidden_chunk^T @ d_logits
    (fp32, the sum over chunks; with one chunk the GEMM's output in the weight's dtype), held for
    backward. weight: [H, V] (PaddleNLP's LM head) or [V, H] with transpose_weight (a tied
    embedding, torch's Linear layout). fp16 logits keep the gradient unscaled (softmax values of a
    128k vocabulary divided by the token count would underflow fp16) and apply 1/n in the GEMMs."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, transpose_weight, chunk_tokens, grad_enabled, n_labelled):
        """n_labelled: the labelled rows' count, found by linear_cross_entropy's gather (the
        forward's one synchronisation)."""
        tokens, width = hidden.shape
        vocab = weight.shape[0] if transpose_weight else weight.shape[1]
        chunk = chunk_tokens or max(1, GPU_CHUNK_BYTES // (4 * vocab))
        mean_scale = 1.0 / n_labelled if n_labelled else 1.0
        kernel_scale, gemm_scale = (1.0, mean_scale) if hidden.dtype == torch.float16 else (mean_scale, 1.0)
        w = weight.t() if transpose_weight else weight  # [H, V] view
        # needs_input_grad follows requires_grad even under torch.no_grad(); the grad mode of the
        # caller (grad_enabled) decides, as paddle.is_grad_enabled() does in the Paddle op.
        need_h, need_w = ctx.needs_input_grad[0] and grad_enabled, ctx.needs_input_grad[1] and grad_enabled
        # d_hidden rows are each one GEMM (K = V, fp32 accumulation inside): written in the inputs'
        # dtype.
        d_hidden = Kernels.empty((tokens, width), hidden.dtype, hidden.device) if need_h else None
        # d_weight: the first chunk's product overwrites it (no zero fill, no read of zeros); with a
        # single chunk it comes out of the GEMM in the weight's dtype (fp32 accumulation inside, one
        # rounding, as a cast of the fp32 result would give), 2 GiB less traffic at a 128k vocab.
        single_chunk = tokens <= chunk
        d_weight = (Kernels.empty(weight.shape, weight.dtype if single_chunk else torch.float32, weight.device)
                    if need_w else None)
        # The kernel's out-of-vocabulary flag, read with backward's one copy to the host.
        error = torch.zeros(1, dtype=torch.int32, device=hidden.device)
        losses = []
        for start in range(0, tokens, chunk):
            end = min(tokens, start + chunk)
            h = hidden[start:end]
            logits = h @ w
            losses.append(cross_entropy(logits, labels[start:end], ignore_index, kernel_scale, need_h or need_w,
                                        error))
            if need_h:
                torch.mm(logits, w.t(), out=d_hidden[start:end]) if gemm_scale == 1.0 else \
                    torch.addmm(d_hidden[start:end], logits, w.t(), beta=0.0, alpha=gemm_scale, out=d_hidden[start:end])
            if need_w:
                a, b = (logits.t(), h) if transpose_weight else (h.t(), logits)
                if single_chunk:
                    torch.addmm(d_weight, a, b, beta=0.0, alpha=gemm_scale, out=d_weight)
                else:
                    _gemm_fp32_out(d_weight, a, b, accumulate=start > 0, alpha=gemm_scale)
            del logits
        if need_w and tokens == 0:  # no chunk wrote it
            d_weight.zero_()
        loss_rows = torch.cat(losses) if losses else torch.zeros(0, device=hidden.device)
        # PaddleNLP's mean over the tokens whose loss is > 0, as a masked sum over a count on the
        # device (NaN when nothing is kept), as the Paddle op computes it.
        kept = loss_rows > 0
        n_kept = kept.sum(dtype=torch.float32)
        loss = torch.where(kept, loss_rows, 0.0).sum() / n_kept
        ctx.pending = (n_labelled, n_kept, error, vocab, ignore_index)
        if not (need_h or need_w):  # no backward will read the flag
            _read_back(ctx.pending)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.save_for_backward(d_hidden, d_weight)
        return loss

    @staticmethod
    def backward(ctx, d_loss):
        d_hidden, d_weight = ctx.saved_tensors
        scale = _read_back(ctx.pending, d_loss)  # one copy to the host per step, as the Paddle op
        grads = [None if g is None else (g if scale == 1.0 else g.mul_(scale)).to(dtype)
                 for g, dtype in zip((d_hidden, d_weight), ctx.dtypes)]
        return grads[0], grads[1], None, None, None, None, None, None


def labelled_rows(hidden2d, labels1d, ignore_index: int):
    """(hidden rows, labels, their count): the rows whose label is not ignore_index, as the Paddle
    op's _labelled_rows (PaddleFormers' filtered label loss): prompt and padding tokens never reach
    the LM head GEMMs (indexing's backward scatters the labelled rows' gradient into a zero
    [T, H]). Finding them is the forward's one synchronisation. With no labelled token, or every
    token labelled, the rows stay as they are."""
    labelled = torch.nonzero(labels1d != ignore_index).reshape(-1)
    count = int(labelled.shape[0])
    if count == 0 or count == labels1d.shape[0]:
        return hidden2d, labels1d, count
    return hidden2d[labelled], labels1d[labelled], count


def linear_cross_entropy(hidden, weight, labels, ignore_index=-100, transpose_weight=False, chunk_tokens=None):
    """hidden [T, H] (or [..., H]); weight [H, V] or, with transpose_weight, [V, H]; labels int64 [T]
    -> fp32 scalar loss (mean over tokens whose loss is > 0), never the [T, V] logits. Only the
    labelled rows reach the LM head (labelled_rows), as in the Paddle op."""
    hidden2d, labels1d, n_labelled = labelled_rows(hidden.reshape(-1, hidden.shape[-1]),
                                                   labels.reshape(-1).long().contiguous(), ignore_index)
    return LinearCrossEntropy.apply(hidden2d, weight, labels1d.contiguous(), ignore_index, transpose_weight,
                                    chunk_tokens, torch.is_grad_enabled(), n_labelled)
