"""The FP8 linear, written once over an FP8 backend (backend.py): y = x @ W (+ b) with both GEMM
operands quantised per tensor and the backward's two GEMMs on the same quantised tensors. The
Paddle emulation (CPU CI), the Paddle CUDA ops and the torch harness all run this class, each
through its framework's autograd adapter (paddle_fastffn/fp8/_autograd.py `pylayer`,
paddle_fastffn/torch/fp8/backend.py `function`).

    forward  q(x) [T, in] (+ q(x)^T)   forward format (e4m3), states.input; ends its step
             q(W)                       states.weight: both copies once per weight version (a
                                        WeightCache), or the forward's copy per use (no cache)
             y [T, out]                 x.dtype = gemm(q(x), q(W)), fast accumulation, + b
             kept for backward          q(x)^T (only where W wants a gradient) and q(W)'s dgrad copy
                                        (per use: W itself, the copy made in backward)
    backward q(dy) (+ q(dy)^T)         backward format (e5m2), states.grad_output, only the
                                        copies the GEMMs that run read
             dx [T, in]                 x.dtype = gemm(q(dy), q(W))
             dW                         W.dtype = gemm(q(x)^T, q(dy)^T)  in the framework's layout
             db [out]                   sum over tokens of dy in fp32 (unquantised, as TE)

Which stored copy each GEMM reads: the backend's fp8_gemm computes D[M, N] = A[M, K] @ B[N, K]^T
from the named stored copies (cuBLASLt's FP8 GEMMs take K-major operands only). x, dy: "rowwise"
[T, C] and "transposed" [C, T16] (T16: the backend's transpose_cols, tokens rounded up to 16 on
the Paddle CUDA path). The weight's copies depend on the framework's layout (WEIGHT_COPIES):

  | GEMM   | D          | A                 | B (Paddle W [in, out])  | B (torch W [out, in])   |
  |--------|------------|-------------------|-------------------------|-------------------------|
  | fwd    | y [T, out] | q(x) rowwise      | q(W) transposed [out,in] | q(W) rowwise [out, in]  |
  | dgrad  | dx [T, in] | q(dy) rowwise     | q(W) rowwise [in, out]  | q(W) transposed [in,out] |
  | wgrad  | dW         | Paddle: q(x)^T [in, T16], B q(dy)^T [out, T16] -> dW [in, out];  |
  |        |            | torch: q(dy)^T [out, T], B q(x)^T [in, T] -> dW [out, in]          |

A frozen weight (LoRA's base) may instead be given as a FrozenFp8Weight (weight None): only the copy
the forward reads stays resident (or both copies, both_copies), one byte a parameter in place of the 16-bit weight's two plus the
cache's two FP8 copies; backward transposes it into the dgrad copy (be.fp8_transpose, a transient of
one weight's size: cuBLASLt's FP8 GEMMs read K-major operands only, and the dgrad's K is the other
dimension). Its numerics are the cached path's: the same per-tensor quantisation, made once.
"""

from __future__ import annotations

from ..autograd import FusedOp, Saved
from .recipe import FAST_ACCUM_FORWARD
from .weight_cache import optimizer_amax

ROWWISE, TRANSPOSED = "rowwise", "transposed"
# The stored copy of the weight each GEMM reads, by the framework's weight layout (the backend's
# weight_layout): Paddle's [in, out], torch's [out, in].
WEIGHT_COPIES = {"in_out": {"forward": TRANSPOSED, "dgrad": ROWWISE},
                 "out_in": {"forward": ROWWISE, "dgrad": TRANSPOSED}}


def weight_for_forward(be, weight, state, weight_cache):
    """(q(W) holding the forward GEMM's copy, the pair backward keeps for its dgrad copy).

    Cached (a WeightCache): both copies, made once per weight version and held until the weight
    changes (2 bytes a parameter beside the 16-bit weight; micro-batches reuse them); backward
    keeps the dgrad copy's (data, scale_inv). Per use (weight_cache None): only the forward's copy,
    a transient of the GEMM; backward keeps (the weight itself, None) and quantises its dgrad copy
    from it (weight_for_dgrad): no FP8 weight memory held, one more read of the weight per
    backward."""
    copies = WEIGHT_COPIES[be.weight_layout]
    if weight_cache is not None:
        q = weight_cache.get(weight, state, be.quantize_weight)
        return q, be.fp8_parts(q, copies["dgrad"])
    recorded = optimizer_amax(weight, state, be.weight_signals)
    return be.quantize_weight(weight, state, copies=(copies["forward"],), amax_recorded=recorded), (weight, None)


def weight_for_dgrad(be, kept, state, per_use: bool):
    """q(W) holding the dgrad GEMM's copy from what weight_for_forward kept. Per use it is quantised
    now with the scale the forward's copy used, still the weight's state's (weights are
    current-scaled and the weight is unchanged until the optimizer steps), its amax max-accumulated
    into the one the forward recorded (the same weight: the same value): the forward copy's bytes,
    transposed, with no amax pass and nothing allocated but the copy."""
    dgrad = WEIGHT_COPIES[be.weight_layout]["dgrad"]
    if not per_use:
        return be.fp8_join(*kept, state.fmt, dgrad)
    return be.quantize(be.contiguous(kept[0]), state.scale_used, state.amax_history, state.fmt,
                       rowwise=dgrad == ROWWISE, transpose=dgrad == TRANSPOSED)


def weight_gradient(be, q_input, q_grad, dtype, layout: str | None = None, out=None):
    """dW from the transposed copies of the layer input and of the output gradient, in the weight
    layout (default the framework's): "in_out" (Paddle's) [in, out] = gemm(q(in)^T, q(grad)^T),
    "out_in" (torch's) [out, in] = gemm(q(grad)^T, q(in)^T); with out (fp32), added into it."""
    if (layout or be.weight_layout) == "in_out":
        return be.fp8_gemm(q_input, TRANSPOSED, q_grad, TRANSPOSED, dtype, out=out)
    return be.fp8_gemm(q_grad, TRANSPOSED, q_input, TRANSPOSED, dtype, out=out)


class FrozenFp8Weight:
    """A frozen weight held only in FP8: the stored copy the forward GEMM reads (the framework's
    WEIGHT_COPIES), its scale_inv, and the weight's shape and dtype. Made once by `freeze` (states:
    the linear's weight ScalingState, which records the amax); nothing updates it, so a weight that
    changes (a load, a merge) needs a new one."""

    def __init__(self, quantized, copies: tuple, fmt: str, shape: tuple, dtype):
        self.quantized, self.copies, self.fmt, self.shape, self.dtype = quantized, copies, fmt, shape, dtype

    @classmethod
    def freeze(cls, be, weight, state, both_copies: bool = False) -> "FrozenFp8Weight":
        """both_copies: the dgrad GEMM's copy too (no transposition in backward, a byte more a
        parameter)."""
        layout = WEIGHT_COPIES[be.weight_layout]
        copies = (layout["forward"], layout["dgrad"]) if both_copies else (layout["forward"],)
        quantized = be.quantize_weight(weight, state, copies=copies)
        return cls(quantized, copies, state.fmt, be.shape(weight), be.dtype(weight))

    def holds(self, copy: str) -> bool:
        return copy in self.copies

    def nbytes(self) -> int:
        """Resident bytes on an FP8 device: the FP8 copies (one byte an element each) and their fp32
        scale_inv (the emulation keeps one fp32 copy for both instead)."""
        rows, cols = self.shape
        return len(self.copies) * rows * cols + 4


class Fp8LinearOp(FusedOp):
    inputs = ("x", "weight", "bias")
    options = ("states", "weight_cache", "frozen_weight")

    @staticmethod
    def forward(be, saved: Saved, x, weight, bias, states, weight_cache, frozen_weight=None):
        need_dw = saved.need("weight", Fp8LinearOp.inputs)
        if (weight is None) == (frozen_weight is None):
            raise ValueError("Fp8LinearOp: give either weight (a tensor) or frozen_weight (a FrozenFp8Weight)")
        x2d = be.contiguous(be.rows(x))
        x_shape, x_dtype = be.shape(x), be.dtype(x)
        transpose_cols = be.transpose_cols(be.shape(x2d)[0])
        qx = states.input.quantize(x2d, backend=be, rowwise=True, transpose=need_dw,
                                   transpose_cols=transpose_cols if need_dw else 0)
        copies = WEIGHT_COPIES[be.weight_layout]
        saved.per_use = frozen_weight is None and weight_cache is None
        if frozen_weight is None:
            qw, w_kept = weight_for_forward(be, weight, states.weight, weight_cache)
            w_fmt, w_dtype = states.weight.fmt, be.dtype(weight)
            saved.weight_copy = copies["dgrad"]
        else:
            qw, w_fmt, w_dtype = frozen_weight.quantized, frozen_weight.fmt, frozen_weight.dtype
            # the dgrad copy where it is held, else the forward's, which backward transposes
            saved.weight_copy = copies["dgrad"] if frozen_weight.holds(copies["dgrad"]) else copies["forward"]
            w_kept = be.fp8_parts(qw, saved.weight_copy)
        y = be.fp8_gemm(qx, ROWWISE, qw, copies["forward"], x_dtype, fast_accum=FAST_ACCUM_FORWARD, bias=bias)
        x_parts = be.fp8_parts(qx, TRANSPOSED) if need_dw else (None, None)
        saved.save(*x_parts, *w_kept)
        saved.grad_state, saved.weight_state, saved.fmts = states.grad_output, states.weight, (states.input.fmt, w_fmt)
        saved.dtypes = (x_dtype, w_dtype, None if bias is None else be.dtype(bias))
        saved.x_shape, saved.transpose_cols = x_shape, transpose_cols
        return be.reshape(y, (*x_shape[:-1], be.shape(y)[-1]))

    @staticmethod
    def backward(be, saved: Saved, grad_output):
        x_data, x_scale_inv, w_data, w_scale_inv = saved.tensors  # per use: the weight and None
        x_dtype, w_dtype, b_dtype = saved.dtypes
        need_dx, need_dw, need_db = saved.needs
        copies = WEIGHT_COPIES[be.weight_layout]
        dy2d = be.contiguous(be.cast(be.rows(grad_output), x_dtype))
        dx = dw = db = None
        if need_dx or need_dw:
            qdy = saved.grad_state.quantize(dy2d, backend=be, rowwise=need_dx, transpose=need_dw,
                                            transpose_cols=saved.transpose_cols if need_dw else 0)
            if need_dx:
                if saved.per_use:
                    qw = weight_for_dgrad(be, (w_data, w_scale_inv), saved.weight_state, per_use=True)
                else:
                    if saved.weight_copy != copies["dgrad"]:
                        w_data = be.fp8_transpose(w_data)
                    qw = be.fp8_join(w_data, w_scale_inv, saved.fmts[1], copies["dgrad"])
                dx = be.reshape(be.fp8_gemm(qdy, ROWWISE, qw, copies["dgrad"], x_dtype), saved.x_shape)
            if need_dw:
                qx = be.fp8_join(x_data, x_scale_inv, saved.fmts[0], TRANSPOSED)
                dw = weight_gradient(be, qx, qdy, w_dtype)
        if need_db:
            db = be.column_sums(dy2d, b_dtype)
        return dx, dw, db
