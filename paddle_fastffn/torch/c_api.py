"""The C API (csrc/kernels, the same sources the Paddle CUDA bindings call) through ctypes: build()
compiles it with nvcc into a shared library, Kernels drives it. PyTorch only allocates memory and
supplies the stream; the GEMMs and attention around our kernels are the backend's (backend.py).

The fused ops' autograd (SwiGLU, RMSNorm, SwiGLUDownProj, the FFN, the fused loss) is not written
here: it is paddle_fastffn/core's classes, which the Paddle ops run too, built into torch Functions
(ops.py) by backend.py over these kernels, with torch's cuBLAS (and the project's cuBLASLt
provider where the Paddle path calls it) standing in for Paddle's GEMMs and SDPA for its attention.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import subprocess
from pathlib import Path

import torch

from paddle_fastffn.core import linear_cross_entropy as core_lce
from paddle_fastffn.torch.build import REPO, definition
from paddle_fastffn.torch.c_structs import (AdamwArgs, AdamwState, CrossEntropyArgs, DeviceLimits, HeadsLayout,  # noqa: F401
                                            RmsNormArgs, RmsNormBwdPlan, RotaryArgs, Scalar, SwigluArgs,
                                            check_abi)

# Tests set this: every output buffer starts as NaN, so an element a kernel fails to write shows.
POISON_OUTPUTS = False

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
# fastffn_moments (fastffn/optimizer.h): the moments' layout, by the moments' torch dtype.
_MOMENT_LAYOUTS = {torch.float32: 0, torch.uint8: 1}


def current_stream() -> ctypes.c_void_p:
    """The current CUDA stream of the current device as the C API's `void* stream`: what
    torch.cuda.current_stream().cuda_stream gives (the same at::cuda::getCurrentCUDAStream, so a
    torch.cuda.stream(s) or torch.cuda.device(d) block is honoured and CUDA is initialised lazily
    by _cuda_getDevice), read by two C calls instead of that function's Python device-index
    resolution and Stream object (~16 Python calls, the FP8 step's largest host cost at ~2300
    kernel calls a step). It is torch inductor's get_raw_stream."""
    c = torch._C
    return ctypes.c_void_p(c._cuda_getCurrentRawStream(c._cuda_getDevice()))


def scalar(value) -> Scalar:
    """A Python number as a host value, a one-element fp32 CUDA tensor as its device address (the
    kernel reads it when it runs: no host sync, and a CUDA graph replays the current value), a
    one-element fp32 CPU tensor (the beta powers, which Paddle keeps on the host) as its value."""
    if isinstance(value, torch.Tensor):
        assert value.dtype == torch.float32 and value.numel() == 1, value  # one element: contiguous
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
        check_abi(self.lib)  # every ctypes mirror against the layouts the library was built with
        self.lib.fastffn_status_string.restype = ctypes.c_char_p
        self.lib.fastffn_last_error.restype = ctypes.c_char_p
        self.lib.fastffn_rms_norm_bwd_workspace_bytes_cuda.restype = ctypes.c_int64
        self.lib.fastffn_rms_norm_bwd_workspace_bytes_cuda.argtypes = [RmsNormArgs]
        self.lib.fastffn_plan_rms_norm_bwd.restype = RmsNormBwdPlan
        self.lib.fastffn_plan_rms_norm_bwd.argtypes = [ctypes.c_int64, ctypes.c_int64, DeviceLimits]
        for name in ("fastffn_device_limits_cuda", *(f"{e}_cuda" for e in ENTRY_POINTS.values())):
            getattr(self.lib, name).restype = ctypes.c_int  # a fastffn_status
        ptr = ctypes.c_void_p
        self.lib.fastffn_adamw_cuda.argtypes = [AdamwArgs, ptr, ptr, ptr, ptr, ptr, ptr]
        self.lib.fastffn_adamw_with_state_cuda.argtypes = [AdamwArgs, ptr, ptr, AdamwState, ptr]
        self.lib.fastffn_adamw_update_pows_cuda.argtypes = [ctypes.c_float, ctypes.c_float, ptr, ptr, ptr]

    def _check(self, status: int, op: str):
        """A failed status as RuntimeError with the C layer's own message (fastffn_last_error)."""
        if status != 0:
            raise RuntimeError(f"{op}: {self.lib.fastffn_status_string(status).decode()}: "
                               f"{self.lib.fastffn_last_error().decode()}")

    _stream = staticmethod(current_stream)

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
            raise RuntimeError("rms_norm_bwd: the current CUDA device's limits could not be read: "
                               f"{self.lib.fastffn_last_error().decode()}")
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=x.device)
        d_x = self.empty(x.shape, x.dtype, x.device)
        d_w = self.empty(weight.shape, weight.dtype, weight.device)
        self._check(self.lib.fastffn_rms_norm_bwd_cuda(
            args, self._ptr(x), self._ptr(weight), self._ptr(rstd), self._ptr(d_out),
            self._ptr(d_sum), self._ptr(d_x), self._ptr(d_w), self._ptr(workspace),
            self._stream()), "rms_norm_bwd")
        return d_x, d_w

    # --- cross-entropy (the fused loss's per-chunk kernel) -----------------------------------
    def cross_entropy(self, logits, labels, ignore_index=-100, grad_scale=1.0, with_grad=True, error=None):
        """The fused kernel in place on logits [rows, V] (fp32/fp16/bf16, unit column stride):
        returns the fp32 [rows] losses; with_grad, logits becomes (softmax - onehot) * grad_scale
        (0 on ignored rows and rows whose loss is not > 0). Labels (int64) outside [0, V) that are
        not ignore_index raise ValueError, read back from the kernel's device flag as the Paddle
        binding does; with `error` (a zeroed device int32 [1]) the flag is left there for the
        caller to read once."""
        rows, vocab = logits.shape
        assert logits.stride(1) == 1 and labels.dtype == torch.int64 and labels.is_contiguous()
        loss = self.empty((rows,), torch.float32, logits.device)
        flag = torch.zeros(1, dtype=torch.int32, device=logits.device) if error is None else error
        args = CrossEntropyArgs(rows, vocab, logits.stride(0) if rows > 1 else vocab, ignore_index, grad_scale,
                                int(with_grad), _DTYPES[logits.dtype], flag.data_ptr())
        self._check(self.lib.fastffn_cross_entropy_cuda(args, self._ptr(logits), self._ptr(labels), self._ptr(loss),
                                                        self._stream()), "cross_entropy")
        if error is None and int(flag.item()) != 0:
            raise core_lce.label_error(vocab, ignore_index)
        return loss

    # --- Rotary -----------------------------------------------------------------------------
    def rotary(self, sources, outputs, dims, layouts, cos, sin, position_ids, position_error,
               inverse):
        """fastffn_rotary_cuda in place, as core/backend.py's `rotary` describes it: sources (q,
        k, v) and outputs (q_out, k_out, v_out) tensors (one tensor may serve several slots; v
        and v_out None = no v), dims (b, s, hq, hk, d), six heads layouts (offset, token_stride,
        group_stride, heads_per_group, head_stride) in elements; cos/sin fp32 [rows, d];
        position_ids int64 [b, s] or None; position_error a zeroed int32 flag or None."""
        b, s, hq, hk, d = dims
        heads = (hq, hk, hk) * 2
        pointers = []
        for slot, (t, layout) in enumerate(zip(tuple(sources) + tuple(outputs), layouts)):
            if t is None:
                pointers.append(ctypes.c_void_p(0))
                continue
            offset, token, group, per_group, head = layout
            assert t.dtype == sources[0].dtype and t.device == sources[0].device, "rotary: tensor"
            # The kernel touches [offset, last) of t's storage: it must lie inside it.
            last = offset + (b * s - 1) * token + (heads[slot] // per_group - 1) * group + \
                (per_group - 1) * head + d
            storage = t.untyped_storage().nbytes() // t.element_size()
            assert t.storage_offset() + last <= storage, f"rotary: slot {slot} layout exceeds its tensor"
            pointers.append(ctypes.c_void_p(t.data_ptr() + offset * t.element_size()))
        plain = [HeadsLayout(*layout[1:]) if layout is not None else HeadsLayout(0, 0, 1, 1)
                 for layout in layouts]
        args = RotaryArgs(b, s, hq, hk, d, *plain, cos.shape[0], int(inverse),
                          _DTYPES[sources[0].dtype], self._ptr(position_error))
        q, k, v, q_out, k_out, v_out = pointers
        self._check(self.lib.fastffn_rotary_cuda(
            args, q, k, v, self._ptr(cos), self._ptr(sin), self._ptr(position_ids), q_out, k_out,
            v_out, self._stream()), "rotary")

    # --- AdamW (fastffn/optimizer.h) ----------------------------------------------------------
    @staticmethod
    def _adamw_args(param, grad, lr, beta1_pow, beta2_pow, beta1, beta2, eps, weight_decay, lr_ratio, with_decay,
                    grad_scale) -> AdamwArgs:
        return AdamwArgs(param.numel(), _DTYPES[param.dtype], _DTYPES[grad.dtype], beta1, beta2, eps, weight_decay,
                         lr_ratio, int(with_decay), scalar(lr), scalar(beta1_pow), scalar(beta2_pow),
                         scalar(grad_scale))

    def adamw(self, param, grad, moment1, moment2, master=None, *, lr, beta1_pow, beta2_pow,
              beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, lr_ratio=1.0, with_decay=True,
              grad_scale=1.0):
        """One step of Paddle's AdamW on one tensor, in place: param (fp32/fp16/bf16), grad (its
        dtype or fp32), master (fp32 or None), moment1/moment2 (fp32), all with param's element
        count (contiguous; any alignment). lr, beta1_pow (beta1^t), beta2_pow and grad_scale: host
        numbers, one-element fp32 CUDA tensors (read by the kernel) or one-element fp32 CPU
        tensors (their values, see scalar)."""
        n = param.numel()
        for t in (param, grad, moment1, moment2, master):
            assert t is None or (t.is_contiguous() and t.numel() == n), "adamw: tensor layout"
        args = self._adamw_args(param, grad, lr, beta1_pow, beta2_pow, beta1, beta2, eps, weight_decay, lr_ratio,
                                with_decay, grad_scale)
        self._check(self.lib.fastffn_adamw_cuda(args, param.data_ptr(), grad.data_ptr(),
                                                master.data_ptr() if master is not None else None,
                                                moment1.data_ptr(), moment2.data_ptr(),
                                                self._stream()), "adamw")

    def adamw_with_state(self, param, grad, moment1, moment2, master=None, compensation=None, moment1_absmax=None,
                         moment2_absmax=None, param_amax=None, *, lr, beta1_pow, beta2_pow, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.01, lr_ratio=1.0, with_decay=True, grad_scale=1.0):
        """adamw over the low-memory state (fastffn/optimizer.h): moment1/moment2 fp32, or uint8
        codes with their fp32 absmax [ceil(numel / 256)] (8-bit moments); compensation (param's
        dtype, 16-bit params without master) for Kahan-compensated weights; param_amax (one fp32
        on param's device) set to the updated param's max |x|."""
        n = param.numel()
        assert param_amax is None or (param_amax.dtype == torch.float32 and param_amax.numel() == 1
                                      and param_amax.device == param.device), "adamw_with_state: param_amax"
        for t in (param, grad, moment1, moment2, master, compensation):
            assert t is None or (t.is_contiguous() and t.numel() == n), "adamw_with_state: tensor layout"
        args = self._adamw_args(param, grad, lr, beta1_pow, beta2_pow, beta1, beta2, eps, weight_decay, lr_ratio,
                                with_decay, grad_scale)
        state = AdamwState(_MOMENT_LAYOUTS[moment1.dtype], *(None if t is None else t.data_ptr() for t in (
            moment1, moment2, moment1_absmax, moment2_absmax, master, compensation, param_amax)))
        self._check(self.lib.fastffn_adamw_with_state_cuda(args, param.data_ptr(), grad.data_ptr(), state,
                                                           self._stream()), "adamw_with_state")

    def adamw_update_pows(self, beta1, beta2, beta1_pow, beta2_pow):
        """beta1_pow *= beta1, beta2_pow *= beta2 on the device (fp32 one-element tensors)."""
        self._check(self.lib.fastffn_adamw_update_pows_cuda(beta1, beta2, beta1_pow.data_ptr(),
                                                            beta2_pow.data_ptr(), self._stream()),
                    "adamw_update_pows")


# Kernels' methods -> the C entry point each runs: every public method but `empty` runs
# fastffn_<method>_cuda (fastffn_<method>_cpu in cpu_kernels). Derived, not listed, so a new
# kernel's method is the one edit here: loading a library resolves each entry point (a method
# named off the rule fails there), and the trace recorder (tests/gpu/trace_torch.py) records
# every call of these methods under the entry point's name.
ENTRY_POINTS = {name: f"fastffn_{name}" for name in vars(Kernels)
                if not name.startswith("_") and name != "empty"}

_KERNELS: Kernels | None = None


def kernels() -> Kernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = Kernels()
    return _KERNELS


def rotary_heads_per_thread_kernels() -> dict[int, Kernels]:
    """{heads per thread: its library} for each value of rotary.cu's tuning knob
    (build_definition's ROTARY_HEADS_PER_THREAD): 1 is the default build (kernels()), the others
    are built with -DFASTFFN_ROTARY_HEADS_PER_THREAD, in parallel (each is a full build). Loaded
    side by side; a caller points _KERNELS at one to run its kernels (bench_gpu's rope_sweep,
    tests/gpu/test_rotary_heads_per_thread.py)."""
    values = [h for h in definition.ROTARY_HEADS_PER_THREAD if h != 1]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(values)) as pool:
        libraries = list(pool.map(lambda h: build(defines=(f"FASTFFN_ROTARY_HEADS_PER_THREAD={h}",)), values))
    return {1: kernels(), **{h: Kernels(library) for h, library in zip(values, libraries)}}


def device_limits(device: int = 0) -> DeviceLimits:
    limits = DeviceLimits()
    kernels()._check(kernels().lib.fastffn_device_limits_cuda(device, ctypes.byref(limits)), "device_limits")
    return limits


def rms_norm_bwd_plan(rows: int, cols: int, limits: DeviceLimits) -> RmsNormBwdPlan:
    return kernels().lib.fastffn_plan_rms_norm_bwd(rows, cols, limits)
