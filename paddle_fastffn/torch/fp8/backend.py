"""The FP8 backend of paddle_fastffn/core/fp8 (backend.py's protocol) for torch, over the ctypes
kernels of fp8/c_api.py (the C entry points the Paddle CUDA ops call), so that the harness runs
the product's own FP8 scaling state machine (core/fp8/scaling.py) and weight cache
(core/fp8/weight_cache.py). Importing it registers it as the scaling states' backend (torch tensors
on the current CUDA device); TorchFp8Backend(device) makes states elsewhere.

Weight freshness: torch bumps a tensor's `_version` on every in-place write, optimizer steps
included, so weight_signals alone see every update (no explicit call is needed, unlike Paddle)."""

from __future__ import annotations

import numpy as np
import torch

from paddle_fastffn.core.fp8 import weight_cache as core_weight_cache
from paddle_fastffn.core.fp8.backend import SharedTensorMethods, register_state_backend
from paddle_fastffn.torch import backend as torch_backend
from paddle_fastffn.torch.fp8 import c_api as fp8

TORCH_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class TorchFp8Backend(SharedTensorMethods):
    name = "torch"

    def __init__(self, device="cuda"):
        self.device = device

    # --- state tensors ------------------------------------------------------------------------
    def fp32_full(self, n: int, value: float, like=None):
        return torch.full((n,), value, dtype=torch.float32, device=self.device if like is None else like.device)

    def to_host(self, t):
        return t.detach().cpu().numpy()

    def copy_from_host(self, t, value) -> None:
        t.copy_(torch.from_numpy(np.asarray(value, np.float32)))

    # --- scaling --------------------------------------------------------------------------------
    def compute_scale(self, amax_history, scale, scale_inv, fmt_max: float, margin: float) -> None:
        fp8.kernels().compute_scale(amax_history, scale, scale_inv, fmt_max, margin)  # reads [0]

    def update_amax_history(self, amax_history, scale, scale_inv, most_recent: bool, fmt_max: float,
                            margin: float) -> None:
        fp8.kernels().update_amax_history(amax_history, scale, scale_inv, fmt_max, margin, most_recent)

    # --- kernels --------------------------------------------------------------------------------
    # An amax (amax[0] of a ScalingState's history) is handed to the kernels whole: they take its
    # address and touch element 0 only (fp8/c_api.py; cpu_kernels' emulation writes [:1]), so no
    # one-element view is made per call.
    def quantize(self, x, scale, amax, fmt: str, rowwise: bool = True, transpose: bool = False,
                 transpose_cols: int = 0, into=None):
        """fastffn_fp8_quantize_cuda into fp8_c_api.Quantized; the harness's copies are never
        padded (its token counts are multiples of 16: Fp8FFN and Fp8Linear check). into: the
        kernel writes the transposed copy straight into its columns of the storage (a strided
        view: the kernel takes out_t's row stride)."""
        if transpose_cols and transpose_cols != x.shape[0]:
            raise ValueError(f"TorchFp8Backend.quantize: transpose_cols must be 0 or the row count {x.shape[0]}, "
                             f"got {transpose_cols} (the harness does not pad tokens)")
        k = fp8.kernels()
        if not (rowwise or transpose):
            k.quantize(x, TORCH_FORMATS[fmt], None, rowwise=False, transpose=False, amax=amax)
            return None
        if into is None:
            return k.quantize(x, TORCH_FORMATS[fmt], scale, rowwise, transpose, amax=amax)
        storage, first_row = into
        out_t = storage[:, first_row:first_row + x.shape[0]]
        q = k.quantize(x, TORCH_FORMATS[fmt], scale, rowwise, transpose=False, amax=amax, out_t=out_t)
        return fp8.Quantized(q.data, None, q.scale, q.scale_inv, q.amax)

    def transposed_rows(self, rows: int, cols: int, fmt: str, like):
        return torch.empty((cols, rows), dtype=TORCH_FORMATS[fmt], device=like.device)

    def transposed_rows_value(self, storage, scale_inv, fmt: str):
        return self.fp8_join(storage, scale_inv, fmt, "transposed")

    def quantize_weight(self, weight, state, copies=("rowwise", "transposed"), amax_recorded=False):
        """The named copies of a weight [out, in] (torch's layout): q(W) for the forward, q(W)^T
        for dgrad; current-scaled (Fp8Recipe: weights)."""
        return state.quantize(weight.detach().contiguous(), backend=self, amax_recorded=amax_recorded,
                              rowwise="rowwise" in copies, transpose="transposed" in copies)

    def fp8_transpose(self, data):
        """fastffn_fp8_quantize_cuda's byte transpose (torch's .t().contiguous() on FP8 runs an
        element-wise copy kernel at a fraction of the bandwidth)."""
        return fp8.kernels().transpose(data)

    def transpose_cols(self, tokens: int) -> int:
        return 0  # never padded: the harness's token counts are multiples of 16

    def fp8_parts(self, q, copy: str):
        return (q.data if copy == "rowwise" else q.data_t), q.scale_inv

    def fp8_join(self, data, scale_inv, fmt: str, copy: str):
        rowwise = copy == "rowwise"
        return fp8.Quantized(data if rowwise else None, None if rowwise else data, None, scale_inv, None)

    def swiglu_fwd_fp8(self, gate_up, h_scale, h_amax, gate_up_scale, gate_up_amax, fmt: str, quantize: bool):
        """fastffn_swiglu_fwd_fp8_cuda: q(h) and, with gate_up_scale, gate_up's row-wise copy in the
        same pass; quantize False: the amax-only pass (both amaxes)."""
        k, f = fp8.kernels(), TORCH_FORMATS[fmt]
        if gate_up_scale is None:
            if not quantize:
                k.swiglu_fwd_fp8(gate_up, f, rowwise=False, amax=h_amax)
                return None
            return k.swiglu_fwd_fp8(gate_up, f, h_scale, amax=h_amax), None
        if not quantize:
            k.swiglu_fwd_fp8_with_gate_up(gate_up, f, rowwise=False, amax=h_amax, gate_up_amax=gate_up_amax)
            return None
        return k.swiglu_fwd_fp8_with_gate_up(gate_up, f, h_scale, amax=h_amax, gate_up_scale=gate_up_scale,
                                             gate_up_rowwise=True, gate_up_amax=gate_up_amax)

    def swiglu_bwd_fp8(self, gate_up, gate_up_scale_inv, d_h, scale, amax, fmt: str, quantize: bool,
                       h_scale=None, h_fmt: str = "", transpose_cols: int = 0):
        """fastffn_swiglu_bwd_fp8_cuda: q(d_gate_up) with its transpose and, with h_fmt, q(h)^T of
        the recomputed h at the forward's h_scale; quantize False: the amax-only pass."""
        k, f = fp8.kernels(), TORCH_FORMATS[fmt]
        if not quantize:
            k.swiglu_bwd_fp8(gate_up, d_h, f, rowwise=False, transpose=False, amax=amax,
                             gate_up_scale_inv=gate_up_scale_inv)
            return None
        return k.swiglu_bwd_fp8(gate_up, d_h, f, scale, amax=amax, h=TORCH_FORMATS[h_fmt or "e4m3"],
                                h_scale=h_scale, h_transpose=bool(h_fmt), gate_up_scale_inv=gate_up_scale_inv)

    def fp8_gemm(self, a, a_copy: str, b, b_copy: str, out_dtype, fast_accum: bool = False, bias=None, out=None):
        """fastffn_gemm_cuda, D[M, N] = A[M, K] @ B[N, K]^T on the named stored copies, + bias; with
        out, accumulated into it (the GEMM's beta = 1)."""
        if out is not None:
            return fp8.kernels().gemm_q(a, b, out.dtype, a_t=a_copy == "transposed", b_t=b_copy == "transposed",
                                        fast_accum=fast_accum, out=out, accumulate=True)
        d = fp8.kernels().gemm_q(a, b, out_dtype, a_t=a_copy == "transposed", b_t=b_copy == "transposed",
                                 fast_accum=fast_accum)
        return d if bias is None else d + bias.to(d.dtype)

    # --- tensors --------------------------------------------------------------------------------
    weight_layout = "out_in"

    @staticmethod
    def weight_signals(weight) -> tuple:
        return weight_signals(weight)

    def rows(self, t):
        return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])

    def contiguous(self, t):
        return t.contiguous()

    def reshape(self, t, shape):
        # t itself where the shape is already right: an autograd.Function's output that is a view
        # made inside it may not be written in place (the LoRA sum accumulates into the FP8 base)
        return t if tuple(t.shape) == tuple(shape) else t.reshape(*shape)

    def cast(self, t, dtype):
        return t.to(dtype)

    def column_sums(self, t, dtype):
        return t.float().sum(0).to(dtype)


TORCH = TorchFp8Backend()
register_state_backend(TORCH)


def weight_signals(weight: torch.Tensor) -> tuple:
    """What torch says about a weight's values: its version counter, buffer, dtype and shape."""
    return (weight._version, weight.data_ptr(), weight.dtype, tuple(weight.shape))


class Fp8WeightCache(core_weight_cache.WeightCache):
    """The core's weight cache over torch's weight_signals. invalidate(): forget every copy (kept
    for training loops that call it after their optimizer step; the version counter already sees
    that step)."""

    def __init__(self):
        super().__init__(weight_signals)

    def invalidate(self) -> None:
        self.clear()


quantize_weight = TORCH.quantize_weight


def function(op, backend=TORCH):
    """backend.py's one autograd.Function adapter over `backend`."""
    return torch_backend.function(op, backend)
