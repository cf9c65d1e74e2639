"""FP8 formats and per-tensor quantisation in pure Paddle: the emulated path of CPU CI and the
reference the CUDA kernels (csrc/kernels/cuda/fp8_cast.cu) are held to.

The contract is fastffn/scaled_tensor.h's, byte for byte:

    q = saturate(round_to_nearest_even(x * scale))        x * scale formed in fp32
    finite x with |x * scale| above the format's max (fp32 overflow too)  -> +-max
    x = +-Inf:  e5m2 +-Inf (0x7C / 0xFC);  e4m3, which has no Inf: NaN (0x7F)
    NaN in x or in x * scale                                              -> NaN (0x7F)
    amax = max |x| over the unscaled input; a NaN in x makes it NaN
    x ~= dequantize(q) = float(q) * scale_inv                             fp32 product

Paddle 3.3.1's fp32 -> float8 casts (they run on CPU) round to nearest even, once, from fp32
(tests/fp8/test_formats.py checks every representable value, every midpoint, one fp32 ulp either
side of it and 200k random values against a float64 reference). They saturate only from the value
the code above the max would have: in the band between, rounding carries into the special codes,
so e4m3fn turns (464, 480) into NaN (0x7F) and e5m2 turns [61440, 65536) into Inf (0x7C); and they
saturate +-Inf to +-max, and e4m3fn turns NaN into 448, so a NaN loss would become a finite number
and hide from the found_inf check of loss scaling. So `quantize` clamps to +-max before the cast
and patches the bytes of non-finite inputs after it (uint8 views of the FP8 tensor; that extra
pass runs only when some value is not finite).
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from ..core.fp8.recipe import FP8_MAX, check_format

FP8_DTYPES = {"e4m3": paddle.float8_e4m3fn, "e5m2": paddle.float8_e5m2}

_NAN_BYTE = 0x7F  # S.1111.111 is e4m3's NaN and S.11111.11 one of e5m2's
_E5M2_POS_INF, _E5M2_NEG_INF = 0x7C, 0xFC


@dataclass
class Quantized:
    """An FP8 tensor with the scalars that give it meaning: x ~= float(data) * scale_inv.

    data: FP8 (paddle.float8_e4m3fn / float8_e5m2), the input's shape; scale_inv: fp32 [1];
    amax: fp32 [1], max |x| of the input it was quantised from."""

    data: paddle.Tensor
    scale_inv: paddle.Tensor
    amax: paddle.Tensor
    fmt: str


def amax_of(x: paddle.Tensor) -> paddle.Tensor:
    """max |x| as fp32 [1] (0 for an empty tensor; NaN if x holds a NaN)."""
    if x.size == 0:
        return paddle.zeros([1], paddle.float32)
    return paddle.abs(x.astype(paddle.float32)).max().reshape([1])


def quantize(x: paddle.Tensor, scale: paddle.Tensor, fmt: str) -> Quantized:
    """x (any float dtype) -> FP8 with the contract above; scale: fp32 [1] (or 0-D).

    x is upcast to fp32 (exact for bf16/fp16) and multiplied by scale in fp32, as the CUDA kernel
    does, so both round the same product once."""
    check_format(fmt)
    with paddle.no_grad():
        x32 = x.astype(paddle.float32)
        scale = scale.astype(paddle.float32).reshape([1])
        y = x32 * scale
        limit = FP8_MAX[fmt]
        data = paddle.clip(y, -limit, limit).astype(FP8_DTYPES[fmt])  # clip keeps NaN: patched below
        if not bool(paddle.isfinite(y).all()):
            data = _patch_non_finite(data, x32, y, fmt)
        return Quantized(data=data, scale_inv=1.0 / scale, amax=amax_of(x32), fmt=fmt)


def _patch_non_finite(data: paddle.Tensor, x32: paddle.Tensor, y: paddle.Tensor, fmt: str):
    """Rewrite the bytes of Inf/NaN inputs with the format's Inf/NaN codes (finite x whose product
    overflowed keep the cast's saturated +-max). Paddle's CPU `where` has no uint8 kernel: int32."""
    codes = data.view(paddle.uint8).astype(paddle.int32)

    def put(mask, byte):
        return paddle.where(mask, paddle.full_like(codes, byte), codes)

    codes = put(paddle.isnan(y), _NAN_BYTE)
    inf = paddle.isinf(x32)  # x = +-Inf decides even when x * scale is NaN (Inf * 0), as in CUDA
    if fmt == "e5m2":
        codes = put(inf & (x32 > 0), _E5M2_POS_INF)
        codes = put(inf & (x32 < 0), _E5M2_NEG_INF)
    else:
        codes = put(inf, _NAN_BYTE)
    return codes.astype(paddle.uint8).view(FP8_DTYPES[fmt])


def dequantize(q: Quantized, dtype=paddle.float32) -> paddle.Tensor:
    """float(q.data) * q.scale_inv in fp32 (NaN -> NaN, e5m2 +-Inf -> +-Inf), then cast to dtype."""
    return from_fp8(q.data, q.scale_inv, dtype)


def from_fp8(data: paddle.Tensor, scale_inv: paddle.Tensor, dtype=paddle.float32) -> paddle.Tensor:
    """dequantize() of FP8 data and its scale_inv held apart (as autograd saves them)."""
    with paddle.no_grad():
        y = data.astype(paddle.float32) * scale_inv
        return y if dtype == paddle.float32 else y.astype(dtype)


def quantize_dequantize(x: paddle.Tensor, scale: paddle.Tensor, fmt: str) -> paddle.Tensor:
    """fp32 values x takes after a round trip through FP8 at this scale."""
    return dequantize(quantize(x, scale, fmt))
