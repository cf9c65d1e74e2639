"""The one table of test tolerances, and the comparison every op test uses.

Kernels are compared against the op's reference evaluated in float64 on the same (exactly upcast)
inputs, so the tolerance is the kernel dtype's own rounding error, not the reference's.
"""

from __future__ import annotations

import math

import numpy as np
import paddle

# (atol, rtol) per storage dtype.
TOLERANCES = {
    # float64 storage computes in double in the CPU kernels: only reduction order differs.
    paddle.float64: (1e-10, 1e-9),
    # fp32 math: fast_expf is within ~2 ulp of expf; row reductions of up to ~1e4 terms add
    # sqrt(n) * 2^-24 relative error, about 1e-6.
    paddle.float32: (1e-5, 1e-5),
    # One rounding to fp16 is 2^-11 (4.9e-4) relative; RMSNorm rounds twice (the normalised row
    # before the weight multiply, as PaddleNLP does), so allow 2 ulp.
    paddle.float16: (1e-3, 2e-3),
    # One rounding to bf16 is 2^-8 (3.9e-3) relative; two roundings (RMSNorm) give 7.8e-3.
    paddle.bfloat16: (1e-2, 1.6e-2),
}


def tolerance(dtype, reduced_rows: int = 1) -> tuple[float, float]:
    """Tolerance for an output; `reduced_rows` > 1 for gradients summed over rows (weight grads):
    per-row rounding errors of random sign grow like sqrt(rows) while the sum itself may cancel,
    so the absolute part grows with sqrt(rows) (as quack's RMSNorm tests do)."""
    atol, rtol = TOLERANCES[dtype]
    return atol * math.sqrt(reduced_rows), rtol


def to_numpy64(t) -> np.ndarray:
    if isinstance(t, paddle.Tensor):
        t = t.astype(paddle.float32).numpy() if t.dtype in (paddle.bfloat16, paddle.float16) else t.numpy()
    return np.asarray(t, dtype=np.float64)


def assert_close(actual, expected, dtype, what: str, reduced_rows: int = 1) -> None:
    """|actual - expected| <= atol + rtol * |expected| everywhere; NaN/Inf never pass. The message
    names the worst index, both values and the tolerance."""
    a, e = to_numpy64(actual), to_numpy64(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    assert np.isfinite(e).all(), f"{what}: the reference itself is not finite"
    assert np.isfinite(a).all(), f"{what}: non-finite values at {np.argwhere(~np.isfinite(a))[:5].tolist()}"
    atol, rtol = tolerance(dtype, reduced_rows)
    excess = np.abs(a - e) - (atol + rtol * np.abs(e))
    if a.size and excess.max() > 0:
        idx = np.unravel_index(int(np.argmax(excess)), a.shape)
        bad = int((excess > 0).sum())
        raise AssertionError(f"{what} [{dtype}]: {bad}/{a.size} elements out of tolerance; worst at "
                             f"{tuple(int(i) for i in idx)}: got {a[idx]!r}, expected {e[idx]!r} "
                             f"(atol {atol:g}, rtol {rtol:g})")
