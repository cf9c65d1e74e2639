"""The comparison the GPU kernel tests share, with the CPU tests' tolerance table by dtype."""

import math

import torch

# (atol, rtol) per dtype: mirrors tests/tolerances.py (see its comments; that file imports Paddle,
# which the GPU machine lacks). CUDA uses __expf (2 ulp) and rsqrtf (2 ulp) in fp32, well inside
# the fp32 row.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]


def close(actual, expected, dtype, what, reduced_rows=1):
    """|actual - expected| <= atol * sqrt(reduced_rows) + rtol * |expected| everywhere (weight
    gradients summed over rows grow like sqrt(rows)); non-finite values never pass."""
    atol, rtol = TOL[dtype]
    atol *= math.sqrt(reduced_rows)
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite (unwritten?) at {torch.nonzero(~torch.isfinite(a))[:5].tolist()}"
    excess = (a - e).abs() - (atol + rtol * e.abs())
    if excess.numel() and excess.max() > 0:
        idx = tuple(int(i) for i in torch.nonzero(excess == excess.max())[0])
        raise AssertionError(f"{what} [{dtype}]: {(excess > 0).sum().item()}/{a.numel()} out of tolerance, "
                             f"worst at {idx}: got {a[idx].item()}, expected {e[idx].item()}")
