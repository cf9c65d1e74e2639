"""What the FP8 core (scaling.py, linear.py, ffn.py) asks of a framework: the FP8
backend protocol. Three implementations: paddle_fastffn/fp8/emulated.py (pure Paddle, fp32 math on
FP8-rounded values: CPU CI and the reference of the kernels), paddle_fastffn/fp8/cuda.py (the
compiled Paddle ops of csrc/paddle/fp8_op.cc and swiglu_fp8_op.cc) and
paddle_fastffn/torch/fp8/backend.py (the same C entry points through ctypes). A method belongs here
only if the core calls it; each says what it must do.

Formats are named "e4m3" and "e5m2" (recipe.FP8_MAX); each backend maps them to its dtypes. A
"quantized" value is the backend's own record of FP8 copies and their scale_inv (the core passes
it through and never looks inside). Scales, scale_invs and amax histories are fp32 tensors of the
backend, updated in place, so that kernels can read and write them on the device with no host
synchronisation.

State storage. ScalingStates make their tensors with the backend they are given, or else the one
the framework registered with register_state_backend (paddle_fastffn.fp8 registers the Paddle
emulated backend, whose tensors the CUDA ops use as well; paddle_fastffn/torch/fp8/backend.py the
torch one). One framework per process: the GPU machine has no Paddle, CPU CI no torch.
"""

from __future__ import annotations

from typing import Any, Protocol

Tensor = Any


class Fp8Backend(Protocol):
    name: str
    # The framework's Linear weight layout: "in_out" (Paddle, [in, out]) or "out_in" (torch,
    # [out, in]); linear.WEIGHT_COPIES says which stored copy of a weight each GEMM reads.
    weight_layout: str

    def weight_signals(self, weight: Tensor) -> tuple:
        """What the framework itself says about a weight's values (its in-place version counter,
        buffer, dtype and shape): with weight_cache's explicit version, what a copy is valid for."""

    # --- activations --------------------------------------------------------------------------
    def rows(self, t: Tensor) -> Tensor:
        """t as 2-D [prod(shape[:-1]), shape[-1]] (a view)."""
    def contiguous(self, t: Tensor) -> Tensor:
        """t itself when dense, else one copy."""
    def reshape(self, t: Tensor, shape: tuple) -> Tensor: ...
    def dtype(self, t: Tensor): ...
    def cast(self, t: Tensor, dtype) -> Tensor:
        """t in dtype (t itself when it has it)."""
    def column_sums(self, t: Tensor, dtype) -> Tensor:
        """The sum over t's rows in fp32, returned in dtype (a bias gradient)."""

    # --- state tensors (fp32) -----------------------------------------------------------------
    def fp32_full(self, n: int, value: float, like: Tensor | None = None) -> Tensor:
        """A new fp32 [n] tensor filled with value (on `like`'s device when given)."""
    def clone(self, t: Tensor) -> Tensor: ...
    def zero_(self, t: Tensor) -> None:
        """t[...] = 0 in place."""
    def shape(self, t: Tensor) -> tuple[int, ...]: ...
    def to_host(self, t: Tensor):
        """A numpy copy of t (checkpoints)."""
    def copy_from_host(self, t: Tensor, value) -> None:
        """t[...] = value (a numpy array of t's shape) in place."""

    # --- scaling (recipe.py's formulas) -----------------------------------------------------------
    def compute_scale(self, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, fmt_max: float,
                      margin: float) -> None:
        """Current scaling, in place: scale = fmt_max * 2^-margin / amax_history[0] (fp32 division,
        clamped to the largest fp32), kept where that amax is 0 or not finite; scale_inv = 1 / scale."""
    def update_amax_history(self, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, most_recent: bool,
                            fmt_max: float, margin: float) -> None:
        """Delayed scaling's end of step, in place: the scale (as compute_scale) from the history's
        max (NaN entries skipped, Inf kept) or, most_recent, from [0]; then the history rolls
        ([0] moves to [-1], the oldest leaves, [0] = 0)."""

    # --- kernels ---------------------------------------------------------------------------------
    def quantize(self, x: Tensor, scale: Tensor, amax: Tensor, fmt: str, rowwise: bool = True,
                 transpose: bool = False, transpose_cols: int = 0, into: tuple | None = None):
        """fastffn_fp8_quantize: x [R, C] -> FP8 copies round(x * scale[0]) saturated
        (fastffn/scaled_tensor.h), max |x| max-accumulated into amax[0] (NaN propagates).
        rowwise: the [R, C] copy; transpose: the [C, transpose_cols or R] copy, zero past R.
        Neither: the amax-only pass (returns None). Else the backend's quantized value (with
        scale_inv = 1 / scale). into (storage, first_row), with transpose: x is rows first_row ..
        first_row + R of a larger tensor, and its transposed copy goes into that tensor's
        transposed_rows storage (columns first_row.. of the [C, rows] copy); the returned value
        holds the row-wise copy (when asked) alone."""
    def transposed_rows(self, rows: int, cols: int, fmt: str, like: Tensor):
        """Storage for the transposed copy of a [rows, cols] FP8 tensor quantised one block of
        rows at a time under one scale (quantize's `into`), on like's device; rows and every
        block's row count multiples of 16 where the backend's GEMMs need it."""
    def transposed_rows_value(self, storage, scale_inv: Tensor, fmt: str):
        """The quantized value whose transposed copy is `storage`, every block written: a GEMM
        operand (its "transposed" copy) dequantised by scale_inv."""
    def quantize_weight(self, weight: Tensor, state, copies: tuple = ("rowwise", "transposed"),
                        amax_recorded: bool = False):
        """The named stored copies of a weight (both: what the weight cache keeps; the forward's
        alone: a FrozenFp8Weight), quantised under `state` (state.quantize with this backend;
        amax_recorded: its amax_history holds the weight's amax already, weight_cache.AmaxSlot)."""
    def fp8_transpose(self, data: Tensor) -> Tensor:
        """A weight's other stored copy from one stored copy's data [R, C]: [C, R], one transpose
        of the FP8 bytes (weights are never padded)."""
    def transpose_cols(self, tokens: int) -> int:
        """The row length of the transposed copies of a [tokens, C] activation: tokens rounded up
        to 16 where the FP8 GEMMs need it padded (Paddle CUDA), 0 (= tokens) elsewhere."""
    def fp8_parts(self, q, copy: str) -> tuple:
        """(data, scale_inv) of q's stored copy `copy` ("rowwise" / "transposed"): what autograd
        saves."""
    def fp8_join(self, data: Tensor, scale_inv: Tensor, fmt: str, copy: str):
        """The quantized value holding `data` as its stored copy `copy` (fp8_parts' inverse)."""
    def fp8_gemm(self, a, a_copy: str, b, b_copy: str, out_dtype, fast_accum: bool = False,
                 bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """fastffn_gemm: D[M, N] = A[M, K] @ B[N, K]^T (+ bias [N]) in out_dtype, fp32
        accumulation, A and B the named stored copies of a and b dequantised by their scale_inv;
        fast_accum: cuBLASLt's fast accumulation (the forward GEMMs). out (an fp32 [M, N], no
        bias): fastffn_gemm_accumulate, out += A @ B^T in place (the GEMM's beta = 1, no [M, N]
        temporary), returned."""
    def swiglu_fwd_fp8(self, gate_up: Tensor, h_scale: Tensor, h_amax: Tensor, gate_up_scale: Tensor | None,
                       gate_up_amax: Tensor | None, fmt: str, quantize: bool):
        """fastffn_swiglu_fwd_fp8: h = silu(gate) * up in fp32 from gate_up [T, 2I] ([gate | up]),
        its amax max-accumulated into h_amax[0] and, with gate_up_scale, gate_up's into
        gate_up_amax[0]. quantize: (q(h) row-wise, gate_up's row-wise copy or None), both in fmt;
        else the amax-only pass (None)."""
    def swiglu_bwd_fp8(self, gate_up: Tensor, gate_up_scale_inv: Tensor | None, d_h: Tensor, scale: Tensor,
                       amax: Tensor, fmt: str, quantize: bool, h_scale: Tensor | None = None,
                       h_fmt: str = "", transpose_cols: int = 0):
        """fastffn_swiglu_bwd_fp8: d_gate_up = [d_h * u * sig * (1 + g (1 - sig)) | d_h * silu(g)]
        in fp32 from gate_up (16/32-bit, or its FP8 copy with gate_up_scale_inv) and d_h, its amax
        into amax[0]. quantize: (q(d_gate_up) both copies, q(h)^T of the recomputed h at h_scale
        in h_fmt, or None without h_fmt); else the amax-only pass (None)."""


class SharedTensorMethods:
    """The protocol's methods that Paddle and torch tensors spell alike (both backends inherit
    them)."""

    def clone(self, t):
        return t.clone()

    def zero_(self, t) -> None:
        t.zero_()

    def shape(self, t) -> tuple:
        return tuple(t.shape)

    def dtype(self, t):
        return t.dtype


_STATE_BACKEND: list = []


def register_state_backend(backend) -> None:
    """The backend whose tensors ScalingStates made without one hold (module docstring)."""
    _STATE_BACKEND[:] = [backend]


def state_backend():
    if not _STATE_BACKEND:
        raise RuntimeError("paddle_fastffn.core.fp8: no FP8 backend is registered for scaling states; import "
                           "paddle_fastffn.fp8 (Paddle) or paddle_fastffn.torch.fp8.backend (torch), or pass backend=")
    return _STATE_BACKEND[0]
