"""The FP8 backend of paddle_fastffn/core/fp8 (backend.py's protocol) for torch, over the ctypes
kernels of fp8_harness.py (the C entry points the Paddle CUDA ops call), so that the harness runs
the product's own FP8 scaling state machine (core/fp8/scaling.py) and weight cache
(core/fp8/weight_cache.py). Importing it registers it as the scaling states' backend (torch tensors
on the current CUDA device); TorchFp8Backend(device) makes states elsewhere.

Weight freshness: torch bumps a tensor's `_version` on every in-place write, optimizer steps
included, so weight_signals alone see every update (no explicit call is needed, unlike Paddle)."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.gpu import fp8_harness as fp8
from paddle_fastffn.core.fp8 import weight_cache as core_weight_cache
from paddle_fastffn.core.fp8.backend import register_state_backend

TORCH_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class TorchFp8Backend:
    name = "torch"

    def __init__(self, device="cuda"):
        self.device = device

    # --- state tensors ------------------------------------------------------------------------
    def fp32_full(self, n: int, value: float, like=None):
        return torch.full((n,), value, dtype=torch.float32, device=self.device if like is None else like.device)

    def clone(self, t):
        return t.clone()

    def zero_(self, t) -> None:
        t.zero_()

    def shape(self, t) -> tuple:
        return tuple(t.shape)

    def to_host(self, t):
        return t.detach().cpu().numpy()

    def copy_from_host(self, t, value) -> None:
        t.copy_(torch.from_numpy(np.asarray(value, np.float32)))

    # --- scaling --------------------------------------------------------------------------------
    def compute_scale(self, amax_history, scale, scale_inv, fmt_max: float, margin: float) -> None:
        fp8.kernels().compute_scale(amax_history[:1], scale, scale_inv, fmt_max, margin)

    def update_amax_history(self, amax_history, scale, scale_inv, most_recent: bool, fmt_max: float,
                            margin: float) -> None:
        fp8.kernels().update_amax_history(amax_history, scale, scale_inv, fmt_max, margin, most_recent)

    # --- kernels --------------------------------------------------------------------------------
    def quantize(self, x, scale, amax, fmt: str, rowwise: bool = True, transpose: bool = False,
                 transpose_cols: int = 0):
        """fastffn_fp8_quantize_cuda into fp8_harness.Quantized; the harness's copies are never
        padded (its token counts are multiples of 16: Fp8FFN and Fp8Linear check)."""
        if transpose_cols not in (0, x.shape[0]):
            raise ValueError(f"TorchFp8Backend.quantize: transpose_cols must be 0 or the row count {x.shape[0]}, "
                             f"got {transpose_cols} (the harness does not pad tokens)")
        k = fp8.kernels()
        if not (rowwise or transpose):
            k.quantize(x, TORCH_FORMATS[fmt], None, rowwise=False, transpose=False, amax=amax[:1])
            return None
        return k.quantize(x, TORCH_FORMATS[fmt], scale, rowwise, transpose, amax=amax[:1])


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


def quantize_weight(weight: torch.Tensor, state):
    """Both copies of a weight [out, in] (torch's layout), current-scaled (Fp8Recipe: weights)."""
    return state.quantize(weight.detach().contiguous(), backend=state.backend, rowwise=True, transpose=True)
