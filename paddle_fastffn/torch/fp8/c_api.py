"""ctypes bindings of the FP8 entry points (csrc/kernels/include/fastffn/scaled_tensor.h) over the
shared library that ``c_api.build()`` compiles: FP8 quantisation (cast + transpose + amax),
dequantisation and the cuBLASLt GEMM provider, the same functions the Paddle bindings call.
torch only allocates, supplies the stream and computes references.

Shapes and precision, row-major throughout:
  quantize    x [R, C] bf16/fp16/fp32 -> q [R, C] fp8 and q_t [C, R] fp8, round(x * scale) with
              saturation, amax = max |x| (fp32), scale_inv = 1 / scale
  transpose   q [R, C] fp8 -> q^T [C, R] fp8, the same bytes (an FP8 copy's other layout)
  dequantize  q [R, C] fp8 -> y [R, C] bf16/fp16/fp32 = q * scale_inv (fp32 product)
  gemm        D[M, N] = alpha * A[M, K] @ B[N, K]^T (+ D), fp32 accumulation; FP8 needs both
              operands K-major (pass the q_t copies for dgrad/wgrad)
  swiglu_fwd_fp8   gate_up [T, 2I] 16/32-bit -> h = silu(g) * u in fp32 -> q(h) [T, I] and/or
              q(h)^T [I, T], amax of h; neither: the amax-only pass of current scaling.
              swiglu_fwd_fp8_with_gate_up also writes q(gate_up) [T, 2I] (and/or its amax)
  swiglu_bwd_fp8   gate_up [T, 2I] (16/32-bit, or q(gate_up) with its scale_inv), d_h [T, I] ->
              q(d_gate_up) [T, 2I] (+ [2I, T]) and the recomputed h (FP8 [T, I] / [I, T], or
              16/32-bit [T, I])
  compute_scale, update_amax_history   per-tensor scales on the device (current / delayed)
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass

import torch

from paddle_fastffn.torch import c_api
from paddle_fastffn.torch.c_structs import GemmConfig, Tensor, check_abi, header_constant

DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 4,
          torch.float8_e5m2: 5}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in DTYPES.items()}
GEMM_TUNING_FIELDS = header_constant("FASTFFN_GEMM_TUNING_FIELDS")
# A tuning record (scaled_tensor.h, fastffn_gemm_tuning_records): its scalars, then the first choice's
# and the winner's algorithm configuration.
GEMM_TUNING_SCALARS = ("m", "n", "k", "a_dtype", "b_dtype", "d_dtype", "flags", "asked", "timed", "chosen",
                       "first_ms", "chosen_ms")
ALGO_CONFIG_FIELDS = ("algorithm_id", "tile_id", "stages_id", "split_k", "cluster_shape_id")
if GEMM_TUNING_FIELDS != len(GEMM_TUNING_SCALARS) + 2 * len(ALGO_CONFIG_FIELDS):
    raise ImportError(f"scaled_tensor.h's FASTFFN_GEMM_TUNING_FIELDS ({GEMM_TUNING_FIELDS}) is not the record this "
                      f"binding reads ({len(GEMM_TUNING_SCALARS)} scalars and two algorithm configurations)")
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_NAN_BYTE = 0x7F  # NaN in both formats: what poisoned FP8 outputs start as

STATUS_INVALID_ARGUMENT = 1
STATUS_UNSUPPORTED_DTYPE = 2
STATUS_LIBRARY_MISSING = 16
STATUS_LIBRARY_ERROR = 17


class Fp8Error(RuntimeError):
    def __init__(self, op: str, status: int, message: str):
        super().__init__(f"{op}: status {status}: {message}")
        self.status = status


@dataclass
class Quantized:
    """An FP8 tensor with its per-tensor scaling state (fp32 device tensors of one element)."""
    data: torch.Tensor | None        # [R, C] fp8
    data_t: torch.Tensor | None      # [C, R] fp8
    scale: torch.Tensor | None
    scale_inv: torch.Tensor
    amax: torch.Tensor | None


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def describe(t: torch.Tensor | None, dtype: torch.dtype | None = None, scale=None, scale_inv=None,
             amax=None, shape: tuple[int, int] = (0, 0)) -> Tensor:
    """The C descriptor of a 2-D view with unit column stride (rows may be strided); None gives a
    NULL data pointer with `dtype` and `shape`. Every FP8 call builds three or more (~7 per FP8
    linear's forward and backward), so each tensor's shape, strides and pointers are read once and
    nothing else is called."""
    scale = None if scale is None else scale.data_ptr()
    scale_inv = None if scale_inv is None else scale_inv.data_ptr()
    amax = None if amax is None else amax.data_ptr()
    if t is None:
        return Tensor(None, DTYPES[dtype], shape[0], shape[1], shape[1], scale, scale_inv, amax)
    dims, strides = t.shape, t.stride()
    assert len(dims) == 2 and (strides[1] == 1 or dims[1] <= 1), "2-D with contiguous rows"
    rows, cols = dims
    stride = strides[0] if rows > 1 else cols
    return Tensor(t.data_ptr(), DTYPES[t.dtype], rows, cols, stride if stride > cols else cols, scale, scale_inv,
                  amax)


def empty(shape, dtype, device="cuda") -> torch.Tensor:
    """An output buffer, NaN-filled while c_api.POISON_OUTPUTS is set (FP8: the NaN byte 0x7F)."""
    if c_api.POISON_OUTPUTS:
        if dtype in FP8_DTYPES:
            return torch.full(shape, FP8_NAN_BYTE, dtype=torch.uint8, device=device).view(dtype)
        return c_api.Kernels.empty(shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)  # c_api.Kernels.empty's unpoisoned buffer


def scalar(value: float, device="cuda") -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


# The GemmConfig of alpha 1 by (transpose_a, transpose_b, accumulate, fast_accum), made once: ctypes
# copies a by-value struct argument into each call, so one object serves every call.
_UNIT_ALPHA_CONFIGS = {flags: GemmConfig(*map(int, flags), 1.0) for flags in itertools.product((False, True), repeat=4)}


def _gemm_config(transpose_a, transpose_b, accumulate, fast_accum, alpha) -> GemmConfig:
    config = _UNIT_ALPHA_CONFIGS.get((transpose_a, transpose_b, accumulate, fast_accum)) if alpha == 1.0 else None
    if config is None:
        config = GemmConfig(int(transpose_a), int(transpose_b), int(accumulate), int(fast_accum), alpha)
    return config


class Fp8Kernels:
    def __init__(self, lib: ctypes.CDLL | None = None):
        if lib is not None:
            check_abi(lib)  # c_api.kernels() checks the library it loads itself
        self.lib = lib or c_api.kernels().lib
        for name in ("fastffn_fp8_quantize_cuda", "fastffn_fp8_dequantize_cuda", "fastffn_gemm_cuda",
                     "fastffn_gemm_init_cuda"):
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.fastffn_fp8_quantize_cuda.argtypes = [Tensor, Tensor, Tensor, ctypes.c_void_p]
        self.lib.fastffn_fp8_dequantize_cuda.argtypes = [Tensor, Tensor, ctypes.c_void_p]
        self.lib.fastffn_gemm_cuda.argtypes = [Tensor, Tensor, Tensor, GemmConfig, ctypes.c_void_p]
        self.lib.fastffn_gemm_init_cuda.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
        self.lib.fastffn_gemm_set_tuning.argtypes = [ctypes.c_int]
        self.lib.fastffn_gemm_set_tuning.restype = ctypes.c_int
        self.lib.fastffn_gemm_get_tuning.restype = ctypes.c_int
        self.lib.fastffn_gemm_tuning_records.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.c_int]
        self.lib.fastffn_gemm_tuning_records.restype = ctypes.c_int
        self.lib.fastffn_last_error.restype = ctypes.c_char_p
        self.lib.fastffn_status_string.restype = ctypes.c_char_p
        self._declare_swiglu_fp8()

    def _check(self, status: int, op: str):
        """A failed status as Fp8Error with the C layer's own message (fastffn_last_error, which
        for the GEMM names the cuBLASLt call or the broken requirement)."""
        if status == 0:
            return
        known = {STATUS_LIBRARY_MISSING: "cuBLASLt missing", STATUS_LIBRARY_ERROR: "cuBLASLt error"}
        message = known.get(status) or self.lib.fastffn_status_string(status).decode()
        raise Fp8Error(op, status, f"{message}. {self.lib.fastffn_last_error().decode()}".strip())

    _stream = staticmethod(c_api.current_stream)

    # --- quantisation ---------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, fp8: torch.dtype, scale: torch.Tensor | None = None,
                 rowwise: bool = True, transpose: bool = True, amax: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, out_t: torch.Tensor | None = None) -> Quantized:
        """x [R, C] -> Quantized. `amax` (fp32, its element 0: the kernel takes a pointer, so an
        amax history may be given whole) is max-accumulated into (a fresh zero when None);
        `out` / `out_t` may be given as (strided) views to write into."""
        rows, cols = x.shape
        device = x.device
        amax = torch.zeros(1, dtype=torch.float32, device=device) if amax is None else amax
        scale_inv = empty((1,), torch.float32, device)
        if rowwise and out is None:
            out = empty((rows, cols), fp8, device)
        if transpose and out_t is None:
            out_t = empty((cols, rows), fp8, device)
        status = self.lib.fastffn_fp8_quantize_cuda(
            describe(x), describe(out, fp8, scale, scale_inv, amax, (rows, cols)),
            describe(out_t, fp8, shape=(cols, rows)), self._stream())
        if status:
            self._check(status, "fp8_quantize")
        return Quantized(out, out_t, scale, scale_inv, amax)

    def transpose(self, data: torch.Tensor, out_t: torch.Tensor | None = None) -> torch.Tensor:
        """An FP8 copy's other layout: data [R, C] -> [C, R], byte for byte (the FP8 x case of
        fastffn_fp8_quantize_cuda: no scaling, no amax)."""
        rows, cols = data.shape
        out_t = empty((cols, rows), data.dtype, data.device) if out_t is None else out_t
        status = self.lib.fastffn_fp8_quantize_cuda(describe(data), describe(None, data.dtype, shape=(rows, cols)),
                                                    describe(out_t), self._stream())
        if status:
            self._check(status, "fp8_transpose")
        return out_t

    def quantize_status(self, x_desc: Tensor, out_desc: Tensor, out_t_desc: Tensor) -> int:
        """The raw status for hand-made descriptors (argument-check tests)."""
        return self.lib.fastffn_fp8_quantize_cuda(x_desc, out_desc, out_t_desc, self._stream())

    def dequantize(self, q: torch.Tensor, scale_inv: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        y = empty(tuple(q.shape), dtype, q.device)
        status = self.lib.fastffn_fp8_dequantize_cuda(describe(q, scale_inv=scale_inv), describe(y),
                                                      self._stream())
        self._check(status, "fp8_dequantize")
        return y

    # --- GEMM -----------------------------------------------------------------------------------
    def gemm_init(self) -> int:
        """Loads cuBLASLt and creates this device's handle; returns cublasLtGetVersion()."""
        version = ctypes.c_size_t(0)
        self._check(self.lib.fastffn_gemm_init_cuda(ctypes.byref(version)), "gemm_init")
        return version.value

    @property
    def gemm_tuning(self) -> int:
        """Candidates the GEMM provider times per new problem (0: the heuristic's first choice,
        untimed); process-wide (scaled_tensor.h, fastffn_gemm_set_tuning)."""
        return self.lib.fastffn_gemm_get_tuning()

    @gemm_tuning.setter
    def gemm_tuning(self, candidates: int):
        self._check(self.lib.fastffn_gemm_set_tuning(int(candidates)), "gemm_set_tuning")

    def gemm_tuning_records(self) -> list[dict]:
        """One dict per problem tuned so far in this process (fastffn_gemm_tuning_records)."""
        count = self.lib.fastffn_gemm_tuning_records(None, 0)
        rows = (ctypes.c_double * (count * GEMM_TUNING_FIELDS))()
        count = min(count, self.lib.fastffn_gemm_tuning_records(rows, count))
        records = []
        for i in range(count):
            row = rows[i * GEMM_TUNING_FIELDS:(i + 1) * GEMM_TUNING_FIELDS]
            scalars, width = len(GEMM_TUNING_SCALARS), len(ALGO_CONFIG_FIELDS)
            m, n, k, a_dtype, b_dtype, d_dtype, flags, asked, timed, chosen, first_ms, chosen_ms = row[:scalars]
            configs = [dict(zip(ALGO_CONFIG_FIELDS, map(int, row[start:start + width])))
                       for start in (scalars, scalars + width)]
            records.append({"m": int(m), "n": int(n), "k": int(k),
                            "dtypes": [DTYPE_NAMES.get(int(t), int(t)) for t in (a_dtype, b_dtype, d_dtype)],
                            "accumulate": bool(int(flags) & 4), "fast_accum": bool(int(flags) & 8),
                            "candidates_asked": int(asked), "candidates_timed": int(timed),
                            "chosen_rank": int(chosen), "first_choice_ms": first_ms, "chosen_ms": chosen_ms,
                            "first_choice_config": configs[0], "chosen_config": configs[1]})
        return records

    def gemm(self, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
             a_scale_inv: torch.Tensor | None = None, b_scale_inv: torch.Tensor | None = None,
             transpose_a: bool = False, transpose_b: bool = False, alpha: float = 1.0,
             fast_accum: bool = False, out: torch.Tensor | None = None,
             accumulate: bool = False) -> torch.Tensor:
        """D[M, N] = alpha * A @ B^T (+ out when accumulate), A = a [M, K] (or a^T with
        transpose_a), B = b [N, K] (or b^T with transpose_b)."""
        if out is None:
            assert not accumulate, "accumulate needs `out`"
            out = empty((a.shape[1] if transpose_a else a.shape[0], b.shape[1] if transpose_b else b.shape[0]),
                        out_dtype, a.device)
        status = self.lib.fastffn_gemm_cuda(describe(a, scale_inv=a_scale_inv),
                                            describe(b, scale_inv=b_scale_inv), describe(out),
                                            _gemm_config(transpose_a, transpose_b, accumulate, fast_accum, alpha),
                                            self._stream())
        if status:
            self._check(status, "gemm")
        return out

    def gemm_q(self, a: Quantized, b: Quantized, out_dtype=torch.bfloat16, a_t=False, b_t=False, **kw):
        """The GEMM of two Quantized tensors, using their row-wise data or (a_t / b_t) their
        transposed copies, each with its scale_inv."""
        return self.gemm(a.data_t if a_t else a.data, b.data_t if b_t else b.data, out_dtype,
                         a_scale_inv=a.scale_inv, b_scale_inv=b.scale_inv, **kw)

    # --- SwiGLU fused with quantisation, scale updates (swiglu_fp8.cu) -------------------------
    def _declare_swiglu_fp8(self):
        lib, f32, ptr = self.lib, ctypes.c_float, ctypes.c_void_p
        lib.fastffn_swiglu_fwd_fp8_cuda.argtypes = [Tensor, Tensor, Tensor, Tensor, ptr]
        lib.fastffn_swiglu_bwd_fp8_cuda.argtypes = [Tensor] * 6 + [ptr]
        lib.fastffn_fp8_compute_scale_cuda.argtypes = [ptr, ptr, ptr, f32, f32, ptr]
        lib.fastffn_fp8_update_amax_history_cuda.argtypes = [ptr, ctypes.c_int64, ctypes.c_int, ptr,
                                                             ptr, f32, f32, ptr]
        for name in ("fastffn_swiglu_fwd_fp8_cuda", "fastffn_swiglu_bwd_fp8_cuda",
                     "fastffn_fp8_compute_scale_cuda", "fastffn_fp8_update_amax_history_cuda"):
            getattr(lib, name).restype = ctypes.c_int

    def raw_status(self, name: str, *args) -> int:
        """The raw status of fastffn_<name> for hand-made arguments (argument-check tests); the
        current stream is appended."""
        return getattr(self.lib, f"fastffn_{name}")(*args, self._stream())

    @staticmethod
    def _fresh_amax(amax, track: bool, device):
        if amax is not None or not track:
            return amax
        return torch.zeros(1, dtype=torch.float32, device=device)

    def swiglu_fwd_fp8(self, gate_up: torch.Tensor, fp8: torch.dtype, scale: torch.Tensor | None = None,
                       rowwise: bool = True, transpose: bool = False, amax: torch.Tensor | None = None,
                       track_amax: bool = True, out: torch.Tensor | None = None,
                       out_t: torch.Tensor | None = None) -> Quantized:
        """gate_up [T, 2I] ([gate | up] rows) -> Quantized h = silu(g) * u: data [T, I] (rowwise),
        data_t [I, T] (transpose). `amax` is max-accumulated (a fresh zero when None, NULL when
        track_amax is False). rowwise = transpose = False is the amax-only pass: scale and
        scale_inv are not touched (scale_inv is None in the result)."""
        return self._swiglu_fwd_fp8(gate_up, fp8, scale, rowwise, transpose, amax, track_amax, out, out_t)[0]

    def swiglu_fwd_fp8_with_gate_up(self, gate_up: torch.Tensor, fp8: torch.dtype,
                                    scale: torch.Tensor | None = None, rowwise: bool = True,
                                    transpose: bool = False, amax: torch.Tensor | None = None,
                                    track_amax: bool = True, out: torch.Tensor | None = None,
                                    out_t: torch.Tensor | None = None, gate_up_scale: torch.Tensor | None = None,
                                    gate_up_rowwise: bool = False,
                                    gate_up_amax: torch.Tensor | None = None) -> tuple[Quantized, Quantized | None]:
        """swiglu_fwd_fp8, and in the same pass gate_up's own FP8 copy (format fp8, the forward's):
        (Quantized h, Quantized gate_up: data [T, 2I] when gate_up_rowwise, quantised with
        gate_up_scale; gate_up_amax max-accumulated when given; None when neither is asked)."""
        return self._swiglu_fwd_fp8(gate_up, fp8, scale, rowwise, transpose, amax, track_amax, out, out_t,
                                    gate_up_scale, gate_up_rowwise, gate_up_amax)

    def _swiglu_fwd_fp8(self, gate_up, fp8, scale, rowwise, transpose, amax, track_amax, out, out_t,
                        gate_up_scale=None, gate_up_rowwise=False, gate_up_amax=None):
        rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
        device = gate_up.device
        amax = self._fresh_amax(amax, track_amax, device)
        converts = rowwise or transpose or out is not None or out_t is not None
        scale_inv = empty((1,), torch.float32, device) if converts else None
        if rowwise and out is None:
            out = empty((rows, cols), fp8, device)
        if transpose and out_t is None:
            out_t = empty((cols, rows), fp8, device)
        q_gate_up, gu_desc = None, describe(None, fp8)
        if gate_up_rowwise or gate_up_amax is not None:
            gu_data = empty((rows, 2 * cols), fp8, device) if gate_up_rowwise else None
            gu_scale_inv = empty((1,), torch.float32, device) if gate_up_rowwise else None
            gu_desc = describe(gu_data, fp8, gate_up_scale, gu_scale_inv, gate_up_amax, (rows, 2 * cols))
            q_gate_up = Quantized(gu_data, None, gate_up_scale, gu_scale_inv, gate_up_amax)
        status = self.lib.fastffn_swiglu_fwd_fp8_cuda(
            describe(gate_up), describe(out, fp8, scale, scale_inv, amax, (rows, cols)),
            describe(out_t, fp8, shape=(cols, rows)), gu_desc, self._stream())
        self._check(status, "swiglu_fwd_fp8")
        return Quantized(out, out_t, scale, scale_inv, amax), q_gate_up

    def swiglu_bwd_fp8(self, gate_up: torch.Tensor, d_h: torch.Tensor, fp8: torch.dtype = torch.float8_e5m2,
                       scale: torch.Tensor | None = None, rowwise: bool = True, transpose: bool = True,
                       amax: torch.Tensor | None = None, track_amax: bool = True,
                       h: torch.dtype | None = None, h_scale: torch.Tensor | None = None,
                       h_rowwise: bool = False, h_transpose: bool = True,
                       h_amax: torch.Tensor | None = None, gate_up_scale_inv: torch.Tensor | None = None):
        """gate_up [T, 2I] (d_h's dtype, or the forward's FP8 copy with gate_up_scale_inv),
        d_h [T, I] -> (Quantized d_gate_up: data [T, 2I], data_t [2I, T]; the recomputed h or
        None). `h`: None (not written), an FP8 dtype (Quantized with h_scale: data [T, I] when
        h_rowwise, data_t [I, T] when h_transpose, h_amax accumulated when given) or d_h's dtype
        (a [T, I] tensor). rowwise = transpose = False with h None is the amax-only pass of
        d_gate_up."""
        rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
        device = gate_up.device
        amax = self._fresh_amax(amax, track_amax, device)
        scale_inv = empty((1,), torch.float32, device) if rowwise or transpose else None
        dgu = empty((rows, 2 * cols), fp8, device) if rowwise else None
        dgu_t = empty((2 * cols, rows), fp8, device) if transpose else None
        h_desc = describe(None, torch.float32)
        h_t_desc = describe(None, torch.float32)
        h_out = None
        if h in FP8_DTYPES:
            h_scale_inv = empty((1,), torch.float32, device)
            h_data = empty((rows, cols), h, device) if h_rowwise else None
            h_data_t = empty((cols, rows), h, device) if h_transpose else None
            h_desc = describe(h_data, h, h_scale, h_scale_inv, h_amax, (rows, cols))
            h_t_desc = describe(h_data_t, h, shape=(cols, rows))
            h_out = Quantized(h_data, h_data_t, h_scale, h_scale_inv, h_amax)
        elif h is not None:
            h_out = empty((rows, cols), h, device)
            h_desc = describe(h_out)
        status = self.lib.fastffn_swiglu_bwd_fp8_cuda(
            describe(gate_up, scale_inv=gate_up_scale_inv), describe(d_h), describe(dgu, fp8, scale, scale_inv, amax, (rows, 2 * cols)),
            describe(dgu_t, fp8, shape=(2 * cols, rows)), h_desc, h_t_desc, self._stream())
        self._check(status, "swiglu_bwd_fp8")
        return Quantized(dgu, dgu_t, scale, scale_inv, amax), h_out

    def compute_scale(self, amax: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor | None,
                      fmt_max: float, margin: float = 0.0):
        """scale = fmt_max * 2^-margin / amax on the device (previous scale kept for an amax that
        is 0 or not finite), scale_inv = 1 / scale; fp32 [1] tensors, updated in place (of amax,
        element 0 is read: an amax history may be given whole)."""
        status = self.lib.fastffn_fp8_compute_scale_cuda(_ptr(amax), _ptr(scale), _ptr(scale_inv),
                                                         fmt_max, margin, self._stream())
        self._check(status, "fp8_compute_scale")

    def update_amax_history(self, history: torch.Tensor, scale: torch.Tensor,
                            scale_inv: torch.Tensor | None, fmt_max: float, margin: float = 0.0,
                            most_recent: bool = False):
        """Delayed scaling's end of step: the scale from max(history) (or history[0]), then the
        history rolls (TE's amax_and_scale_update); all fp32, updated in place."""
        assert history.dim() == 1 and history.is_contiguous() and history.dtype == torch.float32
        status = self.lib.fastffn_fp8_update_amax_history_cuda(
            history.data_ptr(), history.numel(), int(most_recent), None if scale is None else scale.data_ptr(),
            None if scale_inv is None else scale_inv.data_ptr(), fmt_max, margin, self._stream())
        if status:
            self._check(status, "fp8_update_amax_history")


_KERNELS: Fp8Kernels | None = None


def kernels() -> Fp8Kernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = Fp8Kernels()
    return _KERNELS
