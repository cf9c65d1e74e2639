"""FP8 quantisation in pure Paddle against an independent float64 reference: Paddle's fp32 -> FP8
casts round to nearest even and saturate; quantize() adds the Inf/NaN bytes of the CUDA contract
(fastffn/scaled_tensor.h) that Paddle's casts do not produce."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_fastffn.fp8 import FP8_DTYPES, FP8_MAX, dequantize, quantize
from tolerances import assert_close

FORMATS = ["e4m3", "e5m2"]
# Above the max by more than half the last gap, below the value of the code above it (e4m3fn's
# NaN pattern would be 480, e5m2's Inf 65536): must saturate, where Paddle's cast does not.
OVERFLOW_BAND = {"e4m3": [464.25, 470.0, 479.75], "e5m2": [61440.0, 63000.0, 65535.0]}
# (exponent bits, mantissa bits, bias)
LAYOUT = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}


def decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    """Values of FP8 bit patterns, from the bit layout (exponent 0 is subnormal); no Inf/NaN."""
    e_bits, m_bits, bias = LAYOUT[fmt]
    c = codes.astype(np.int64)
    exponent, mantissa = (c >> m_bits) & ((1 << e_bits) - 1), c & ((1 << m_bits) - 1)
    magnitude = np.where(exponent == 0, mantissa / 2.0**m_bits * 2.0 ** (1 - bias),
                         (1 + mantissa / 2.0**m_bits) * 2.0 ** (exponent - bias))
    return np.where(c & 0x80, -magnitude, magnitude)


def positive_finite(fmt):
    codes = np.arange(128)
    values = decode(codes, fmt)
    keep = values <= FP8_MAX[fmt]  # drops e4m3's NaN and e5m2's Inf/NaN codes, which sort last
    return codes[keep], values[keep]


def round_reference(y: np.ndarray, fmt: str) -> np.ndarray:
    """Codes of finite y rounded to nearest even (ties to the even code), saturating at +-max."""
    codes, values = positive_finite(fmt)
    mag = np.abs(y.astype(np.float64))
    hi = np.clip(np.searchsorted(values, mag), 0, len(values) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0)) | (values[hi] == mag)
    code = np.where(pick_hi, codes[hi], codes[lo])
    code = np.where(mag > values[-1], codes[-1], code)
    return fold_zero((code | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8))


def fold_zero(codes):
    """-0 (0x80) as +0: the sign of a zero is not part of the contract."""
    return np.where(codes == 0x80, 0, codes).astype(np.uint8)


def codes_of(q) -> np.ndarray:
    return fold_zero(q.data.view(paddle.uint8).numpy())


def assert_codes_equal(got, expected, inputs, what):
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, (f"{what}: {bad.size}/{got.size} codes differ; first at input "
                           f"{inputs.reshape(-1)[bad[0]]!r}: got 0x{got.reshape(-1)[bad[0]]:02x}, "
                           f"expected 0x{expected.reshape(-1)[bad[0]]:02x}")


def test_decode_matches_paddle():
    """The independent decoder agrees with Paddle's FP8 -> fp32 cast on every finite code."""
    for fmt in FORMATS:
        codes = np.arange(256, dtype=np.uint8)
        paddle_values = paddle.to_tensor(codes).view(FP8_DTYPES[fmt]).astype(paddle.float32).numpy()
        finite = np.isfinite(paddle_values)
        np.testing.assert_array_equal(decode(codes, fmt)[finite], paddle_values[finite])
        assert decode(codes, fmt)[finite].max() == FP8_MAX[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_rounds_to_nearest_even_and_saturates(fmt):
    """Every finite value, every midpoint between neighbours (exact ties: the even code wins), one
    fp32 ulp either side of each midpoint, below half the smallest subnormal, beyond the max."""
    _, values = positive_finite(fmt)
    mids = ((values[1:] + values[:-1]) / 2).astype(np.float32)  # exact: one bit more than FP8
    below, above = np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))
    top = values[-1]
    beyond = np.array([top * 1.01, *OVERFLOW_BAND[fmt], top * 1.5, top * 1e3, 1e30, 3.4e38], np.float32)
    y = np.concatenate([values.astype(np.float32), mids, below, above, beyond])
    y = np.concatenate([y, -y])
    q = quantize(paddle.to_tensor(y), paddle.ones([1]), fmt)
    assert_codes_equal(codes_of(q), round_reference(y, fmt), y, f"{fmt} RNE")
    # Paddle's own cast agrees everywhere but in the overflow band (next test).
    in_band = np.isin(np.abs(y), np.float32(OVERFLOW_BAND[fmt]))
    raw = fold_zero(paddle.to_tensor(y).astype(FP8_DTYPES[fmt]).view(paddle.uint8).numpy())
    assert_codes_equal(raw[~in_band], round_reference(y, fmt)[~in_band], y[~in_band], f"{fmt} paddle cast")


def test_paddle_cast_overflow_band():
    """Pins the Paddle 3.3.1 behaviour quantize() works around by clamping first: between the max
    and the value of the code above it, rounding carries into e4m3fn's NaN / e5m2's Inf code.
    If this fails, Paddle changed its cast: the clamp stays correct, this docstring needs an update."""
    for fmt, special in (("e4m3", 0x7F), ("e5m2", 0x7C)):
        band = paddle.to_tensor(np.float32(OVERFLOW_BAND[fmt]))
        assert (band.astype(FP8_DTYPES[fmt]).view(paddle.uint8).numpy() == special).all(), fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_rounds_once_from_fp32(fmt):
    """Random fp32 over the whole range of the format: a conversion through an intermediate
    format (double rounding) would differ from the single rounding of the reference."""
    rng = np.random.default_rng(0)
    exponents = rng.uniform(-22, np.log2(FP8_MAX[fmt]) + 1, 200_000)
    y = (rng.choice([-1.0, 1.0], exponents.size) * 2.0**exponents).astype(np.float32)
    q = quantize(paddle.to_tensor(y), paddle.ones([1]), fmt)
    assert_codes_equal(codes_of(q), round_reference(y, fmt), y, f"{fmt} random")


@pytest.mark.parametrize("dtype", [paddle.float32, paddle.bfloat16, paddle.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_multiplies_in_fp32_before_rounding(fmt, dtype):
    """q = round(fp32(x) * scale): one fp32 product, rounded once; amax of the unscaled input."""
    x = (paddle.randn([37, 53]) * 3).astype(dtype)
    scale = paddle.to_tensor([FP8_MAX[fmt] / 4.0 * 0.917], paddle.float32)  # not a power of two
    q = quantize(x, scale, fmt)
    x32 = x.astype(paddle.float32).numpy()
    product = x32 * np.float32(scale.numpy()[0])
    assert_codes_equal(codes_of(q), round_reference(product, fmt), product, f"{fmt} scaled")
    assert q.amax.numpy()[0] == np.abs(x32).max()
    assert q.scale_inv.numpy()[0] == np.float32(1) / scale.numpy()[0]
    assert (np.abs(product) > FP8_MAX[fmt]).any(), "the scale should make some values saturate"


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_within_half_an_fp8_ulp(fmt):
    """|dequantize(q) * scale - x * scale| <= the format's row in tests/tolerances.py, in the
    scaled domain (where the FP8 grid lives), for every value the scale keeps in range."""
    x = paddle.randn([301, 67]) * paddle.exp(paddle.randn([301, 67]) * 2)  # wide dynamic range
    scale = paddle.to_tensor([FP8_MAX[fmt] / float(paddle.abs(x).max())])
    q = quantize(x, scale, fmt)
    scaled_back = dequantize(q) * scale
    assert_close(scaled_back, x * scale, FP8_DTYPES[fmt], f"{fmt} round trip")


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_inputs_keep_the_cuda_bytes(fmt):
    """NaN -> 0x7F; Inf -> e5m2 Inf (0x7C / 0xFC), e4m3 NaN (0x7F); finite overflow -> +-max.
    Paddle's own cast would give e4m3 448 for NaN and +-max for Inf in both formats."""
    nan, inf = float("nan"), float("inf")
    x = paddle.to_tensor([1.0, nan, inf, -inf, 1e30, -1e30, 0.0], paddle.float32)
    q = quantize(x, paddle.ones([1]), fmt)
    inf_codes = [0x7C, 0xFC] if fmt == "e5m2" else [0x7F, 0x7F]
    max_code = 0x7E if fmt == "e4m3" else 0x7B
    expected = [round_reference(np.float32([1.0]), fmt)[0], 0x7F, *inf_codes, max_code, max_code | 0x80, 0]
    assert codes_of(q).tolist() == expected
    values = dequantize(q).numpy()
    assert np.isnan(values[1])
    if fmt == "e5m2":
        assert values[2] == inf and values[3] == -inf
    else:
        assert np.isnan(values[2:4]).all()
    assert np.isnan(q.amax.numpy()[0]), "a NaN in x makes amax NaN"


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_scale_and_inf_times_zero(fmt):
    """x * scale NaN (NaN scale) -> 0x7F everywhere; x = Inf with scale 0 (Inf * 0 = NaN) is still
    the format's Inf byte: x decides, as in the CUDA kernel."""
    x = paddle.to_tensor([1.0, -2.0, 0.0], paddle.float32)
    assert codes_of(quantize(x, paddle.to_tensor([float("nan")]), fmt)).tolist() == [0x7F] * 3
    q = quantize(paddle.to_tensor([float("inf")]), paddle.zeros([1]), fmt)
    assert codes_of(q).tolist() == [0x7C if fmt == "e5m2" else 0x7F]


def test_empty_tensor():
    q = quantize(paddle.zeros([0, 16]), paddle.ones([1]), "e4m3")
    assert q.data.shape == [0, 16] and float(q.amax) == 0.0
