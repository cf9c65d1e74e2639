"""The Paddle emulated FP8 backend (core/fp8/backend.py's protocol in pure Paddle): what CPU CI runs,
and the reference the CUDA kernels are held to. Quantisation is formats.py's (the kernels' byte
contract); scales follow recipe.py's formulas in Paddle ops. Its tensors are also the scaling
states' storage on the CUDA path (core/fp8/backend.py: it is the registered state backend)."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from ..core.fp8.backend import SharedTensorMethods, register_state_backend
from ..core.fp8.recipe import FP32_MAX, scale_numerator, scaled_max
from .formats import Quantized, amax_of, from_fp8, quantize as quantize_tensor


def scale_from_amax(amax: paddle.Tensor, fmt: str, margin: float, previous: paddle.Tensor) -> paddle.Tensor:
    """fp32 [1]: fp8_max * 2^-margin / amax (fp32 division, as TE), `previous` where amax is 0 or
    not finite, clamped to the largest fp32."""
    return _scale_from_amax(amax, scaled_max(fmt, margin), previous)


def _scale_from_amax(amax, numerator: float, previous):
    amax = amax.astype(paddle.float32).reshape([1])
    usable = paddle.isfinite(amax) & (amax > 0)
    safe_amax = paddle.where(usable, amax, paddle.ones_like(amax))
    scale = paddle.clip(paddle.full([1], numerator, paddle.float32) / safe_amax, max=FP32_MAX)
    return paddle.where(usable, scale, previous.astype(paddle.float32).reshape([1]))


def _max_into(slot: paddle.Tensor, amax: paddle.Tensor) -> None:
    """slot[0] = max(slot[0], amax), NaN from either side kept (the kernels' amax contract)."""
    current = slot[:1]
    new = paddle.where(paddle.isnan(amax) | paddle.isnan(current), paddle.full_like(current, float("nan")),
                       paddle.maximum(current, amax))
    paddle.assign(new, output=slot[:1])


# --- SwiGLU in fp32 (swiglu_fp8.cu's expressions) --------------------------------------------------

def _gate_and_up(gate_up: paddle.Tensor):
    return paddle.chunk(gate_up.astype(paddle.float32), 2, axis=-1)


def swiglu_fwd32(gate_up: paddle.Tensor) -> paddle.Tensor:
    """h = silu(gate) * up in fp32 from gate_up [T, 2I] ([gate | up]) of any float dtype."""
    gate, up = _gate_and_up(gate_up)
    return gate * F.sigmoid(gate) * up


def swiglu_bwd32(gate_up: paddle.Tensor, d_h: paddle.Tensor):
    """(d_gate_up [T, 2I] = [d_gate | d_up], the recomputed h [T, I]) in fp32; h is the bits of
    swiglu_fwd32's."""
    gate, up = _gate_and_up(gate_up)
    d_h = d_h.astype(paddle.float32)
    sig = F.sigmoid(gate)
    silu = gate * sig
    d_gate_up = paddle.concat([d_h * up * sig * (1 + gate * (1 - sig)), d_h * silu], axis=-1)
    return d_gate_up, silu * up


class RowBlocks:
    """transposed_rows storage on Paddle: the blocks of FP8 copies as quantised, joined once every
    one is written (Paddle has no kernel that writes an FP8 tensor into part of another, set_value
    included, so the blocks are concatenated: one copy of the whole)."""

    def __init__(self, rows: int):
        self.rows, self.blocks = rows, []

    def add(self, first_row: int, data) -> None:
        self.blocks.append((first_row, data))

    def joined(self, axis: int):
        """The blocks in row order concatenated along `axis` (their row axis), checked to tile the
        rows exactly."""
        blocks = sorted(self.blocks, key=lambda block: block[0])
        expected = 0
        for first_row, data in blocks:
            if first_row != expected:
                raise ValueError(f"RowBlocks: a block starts at row {first_row}, expected {expected}")
            expected += data.shape[axis]
        if expected != self.rows:
            raise ValueError(f"RowBlocks: the blocks hold {expected} rows of {self.rows}")
        data = [d for _, d in blocks]
        return data[0] if len(data) == 1 else paddle.concat(data, axis=axis)


class PaddleFp8Tensors(SharedTensorMethods):
    """The Paddle tensor side of core/fp8/backend.py's protocol, shared by the emulated and the CUDA
    backend: state tensors, 2-D views, dtypes, Paddle's [in, out] weight layout."""

    weight_layout = "in_out"

    @staticmethod
    def weight_signals(weight) -> tuple:
        """What Paddle itself says about a weight's values: inplace version, buffer, dtype, shape."""
        return (weight._inplace_version(), weight.data_ptr(), weight.dtype, tuple(weight.shape))

    # --- state tensors ------------------------------------------------------------------------
    def fp32_full(self, n: int, value: float, like=None):
        out = paddle.full([n], value, paddle.float32)
        return out if like is None or like.place.is_cpu_place() else out.cuda(like.place.gpu_device_id())

    def to_host(self, t):
        return t.numpy()

    def copy_from_host(self, t, value) -> None:
        paddle.assign(paddle.to_tensor(np.asarray(value, np.float32), place=t.place), output=t)

    # --- activations ----------------------------------------------------------------------------
    def rows(self, t):
        return t.reshape([-1, t.shape[-1]])

    def contiguous(self, t):
        return t if t.is_contiguous() else t.contiguous()

    def reshape(self, t, shape):
        return t.reshape(list(shape))

    def cast(self, t, dtype):
        return t if t.dtype == dtype else t.astype(dtype)

    def column_sums(self, t, dtype):
        """Sum over the rows in fp32, in `dtype` (a bias gradient, unquantised)."""
        return t.astype(paddle.float32).sum(axis=0).astype(dtype)

    @staticmethod
    def transposed_rows(rows: int, cols: int, fmt: str, like):
        """Blocks joined when every one is written (RowBlocks): each backend's transposed_rows_value
        says along which axis its copies hold their rows."""
        return RowBlocks(rows)


class EmulatedFp8Backend(PaddleFp8Tensors):
    name = "paddle-emulated"

    # --- scaling --------------------------------------------------------------------------------
    def _set_scale(self, scale, scale_inv, value) -> None:
        paddle.assign(value, output=scale)
        paddle.assign(1.0 / value, output=scale_inv)

    def compute_scale(self, amax_history, scale, scale_inv, fmt_max: float, margin: float) -> None:
        with paddle.no_grad():
            self._set_scale(scale, scale_inv, _scale_from_amax(amax_history[:1], scale_numerator(fmt_max, margin), scale))

    def update_amax_history(self, amax_history, scale, scale_inv, most_recent: bool, fmt_max: float,
                            margin: float) -> None:
        with paddle.no_grad():
            history = amax_history
            if most_recent:
                amax = history[:1]
            else:  # TE's fmaxf reduction: NaN entries skipped, Inf kept
                amax = paddle.where(paddle.isnan(history), paddle.zeros_like(history), history).max().reshape([1])
            self._set_scale(scale, scale_inv, _scale_from_amax(amax, scale_numerator(fmt_max, margin), scale))
            slot = paddle.zeros([1], paddle.float32).astype(history.dtype)
            rolled = paddle.concat([slot, history[2:], history[:1]]) if history.shape[0] > 1 else slot
            paddle.assign(rolled, output=history)

    # --- kernels --------------------------------------------------------------------------------
    def quantize(self, x, scale, amax, fmt: str, rowwise: bool = True, transpose: bool = False,
                 transpose_cols: int = 0, into=None):
        """formats.quantize (one copy, x's own layout: it serves as both stored copies, the GEMMs
        transpose as they read it); neither copy asked: the amax-only pass. into: the copy is also
        the storage's block at first_row (transposed_rows)."""
        with paddle.no_grad():
            if not (rowwise or transpose):
                _max_into(amax, amax_of(x))
                return None
            q = quantize_tensor(x, scale, fmt)
            _max_into(amax, q.amax)
            if into is not None:
                storage, first_row = into
                storage.add(first_row, q.data)
            return q

    def transposed_rows_value(self, storage, scale_inv, fmt: str):
        """The blocks in row order as one [rows, cols] copy (it serves as the transposed one, as
        every copy here does)."""
        return Quantized(data=storage.joined(axis=0), scale_inv=scale_inv, amax=None, fmt=fmt)

    def quantize_weight(self, weight, state, copies=("rowwise", "transposed"), amax_recorded=False):
        """q(W) (records the weight's amax in `state`): one copy serves every GEMM here."""
        return state.quantize(weight, backend=self, amax_recorded=amax_recorded)

    def fp8_transpose(self, data):
        return data  # the one copy is both stored copies: the GEMMs transpose as they read it

    def transpose_cols(self, tokens: int) -> int:
        return 0  # no padded copies: the emulation's GEMMs have no alignment rule

    def fp8_parts(self, q, copy: str):
        return q.data, q.scale_inv

    def fp8_join(self, data, scale_inv, fmt: str, copy: str):
        return Quantized(data=data, scale_inv=scale_inv, amax=None, fmt=fmt)

    def swiglu_fwd_fp8(self, gate_up, h_scale, h_amax, gate_up_scale, gate_up_amax, fmt: str, quantize: bool):
        """h = silu(gate) * up in fp32 (never rounded to 16 bits), its amax into h_amax and, with
        gate_up_scale, gate_up's into gate_up_amax; quantize: (q(h), q(gate_up) or None)."""
        with paddle.no_grad():
            h = swiglu_fwd32(gate_up)
            copy = gate_up_scale is not None
            if not quantize:
                _max_into(h_amax, amax_of(h))
                if copy:
                    _max_into(gate_up_amax, amax_of(gate_up))
                return None
            return self.quantize(h, h_scale, h_amax, fmt), (
                self.quantize(gate_up, gate_up_scale, gate_up_amax, fmt) if copy else None)

    def swiglu_bwd_fp8(self, gate_up, gate_up_scale_inv, d_h, scale, amax, fmt: str, quantize: bool,
                       h_scale=None, h_fmt: str = "", transpose_cols: int = 0):
        """d_gate_up = [d_gate | d_up] in fp32 from the kept gate_up (its FP8 copy dequantised in
        fp32 where gate_up_scale_inv is given) and d_h, its amax into amax; quantize: (q(d_gate_up),
        q(h) of the recomputed h at the forward's h_scale, or None without h_fmt)."""
        with paddle.no_grad():
            if gate_up_scale_inv is not None:
                gate_up = from_fp8(gate_up, gate_up_scale_inv)  # fp32, as the kernel reads the copy
            d_gate_up, h = swiglu_bwd32(gate_up, d_h)
            if not quantize:
                _max_into(amax, amax_of(d_gate_up))
                return None
            q_h = quantize_tensor(h, h_scale, h_fmt) if h_fmt else None
            return self.quantize(d_gate_up, scale, amax, fmt), q_h

    def fp8_gemm(self, a, a_copy: str, b, b_copy: str, out_dtype, fast_accum: bool = False, bias=None, out=None):
        """D[M, N] = A[M, K] @ B[N, K]^T in fp32 on the dequantised FP8 values (exact products; only
        the summation order differs from the tensor cores'), + bias in fp32, then out_dtype (or added
        into the fp32 `out`). A "transposed" copy is the one stored tensor read transposed."""
        with paddle.no_grad():
            d = paddle.matmul(from_fp8(a.data, a.scale_inv), from_fp8(b.data, b.scale_inv),
                              transpose_x=a_copy == "transposed", transpose_y=b_copy == "rowwise")
            if out is not None:
                return out.add_(d)
            if bias is not None:
                d = d + bias.astype(paddle.float32)
            return d if d.dtype == out_dtype else d.astype(out_dtype)


EMULATED = EmulatedFp8Backend()
register_state_backend(EMULATED)
