"""FP8 building blocks through the standalone harness (paddle_fastffn/torch/fp8/c_api.py): quantisation
(cast + transpose + amax), dequantisation and the cuBLASLt GEMM provider, against torch's own
float8 conversion and float64 references. Outputs are poisoned before every call (NaN; for FP8 the
NaN byte 0x7F) so an element a kernel fails to write shows."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from paddle_fastffn.torch.fp8 import c_api as fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = [E4M3, E5M2]
FORMAT_IDS = ["e4m3", "e5m2"]
INPUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INPUT_IDS = ["bf16", "fp16", "fp32"]

# --- tolerances, with the numerics behind each ---------------------------------------------------
# Quantisation and dequantisation are compared bit for bit: kernel and reference both form one
# IEEE fp32 product (x * scale, q * scale_inv) and round it once, to nearest even (+-0 are equal).
#
# Round trip x -> FP8 -> x, for values the scale keeps inside the format: half an FP8 ulp relative
# (e4m3 has 3 mantissa bits: 2^-4; e5m2 2: 2^-3), or half the smallest subnormal spacing absolute
# below the normal range (e4m3 2^-10, e5m2 2^-17), both in the scaled domain.
ROUND_TRIP = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}
#
# GEMMs are checked element-wise as |got - ref| <= u_out * |ref| + accumulation(K) * sum_k |a b|
# against a float64 GEMM of the (dequantised) inputs, plus a norm-wise relative error bound.
# u_out: one round-to-nearest into the output dtype (bf16 8 significant bits, fp16 11, fp32 24).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# Accumulation error relative to sum_k |a_mk b_nk| (what any summation order's error is a multiple
# of). 16-bit inputs: products are exact in fp32 and sums round in fp32 (tensor cores truncate
# rather than round: allow 4x the sqrt(K) random walk of 2^-24). FP8: Hopper's tensor cores add
# FP8 products into partial sums of about 14 bits (DeepSeek-V3 report, section 3.3.2); cuBLASLt
# promotes them into fp32 every few k-blocks, so the error does not grow with K: a few 2^-13.
# fast_accum skips the promotion and the narrow partial sum runs over all of K.
ACCUMULATION = {
    "16bit": lambda k: 4 * math.sqrt(k) * 2.0**-24,
    "fp8": lambda k: 2.0**-11,
    "fp8_fast": lambda k: 2.0**-9,
}
# ||got - ref|| / ||ref|| (Frobenius) on random inputs, beside the element-wise bound: the
# element-wise bound is loose where sum |a b| >> |ref| (cancellation); the norm catches a
# systematic error hiding under it. FP8 estimates: per-step truncation of 2^-13 on partial sums of
# ~sqrt(32) terms, random over K/32 steps: ~1e-4 (promoted), ~1e-3 (fast); bounds leave 8-16x.
NORM_ERROR = {"16bit": 2.0**-16, "fp8": 2.0**-10, "fp8_fast": 2.0**-6}


@pytest.fixture(scope="module")
def k():
    return fp8.kernels()


# --- references ---------------------------------------------------------------------------------

def fold_zero(codes: torch.Tensor) -> torch.Tensor:
    """FP8 bytes with -0 (0x80) folded into +0: the sign of a zero is not part of the contract."""
    return torch.where(codes == 0x80, torch.zeros_like(codes), codes)


def quantize_ref(x: torch.Tensor, scale: torch.Tensor | None, fmt: torch.dtype) -> torch.Tensor:
    """The bytes the kernel must write: the fp32 product, saturation (torch's .to() does not
    saturate: e4m3 overflows to NaN, e5m2 to Inf, so clamp first), torch's round-to-nearest-even
    conversion, then the format's Inf/NaN rules of scaled_tensor.h."""
    x32 = x.float()
    y = x32 * scale if scale is not None else x32
    limit = fp8.FP8_MAX[fmt]
    codes = y.clamp(-limit, limit).to(fmt).view(torch.uint8).clone()
    codes[torch.isnan(y)] = 0x7F
    inf = torch.isinf(x32)
    if fmt is E5M2:
        codes[inf & (x32 > 0)] = 0x7C
        codes[inf & (x32 < 0)] = 0xFC
    else:
        codes[inf] = 0x7F
    return fold_zero(codes)


def assert_bytes_equal(got: torch.Tensor, expected: torch.Tensor, what: str):
    got = fold_zero(got.view(torch.uint8))
    expected = fold_zero(expected.view(torch.uint8))
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    bad = got != expected
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())}/{got.numel()} bytes differ, first at {idx}: "
                             f"got 0x{int(got[idx]):02x}, expected 0x{int(expected[idx]):02x}")


def assert_same_floats(got: torch.Tensor, expected: torch.Tensor, what: str):
    """Equal values, NaN where the reference has NaN (and nowhere else)."""
    nan_got, nan_expected = torch.isnan(got), torch.isnan(expected)
    assert torch.equal(nan_got, nan_expected), f"{what}: NaN at {torch.nonzero(nan_got != nan_expected)[:5].tolist()}"
    same = (got == expected) | nan_expected
    if not same.all():
        idx = tuple(int(i) for i in torch.nonzero(~same)[0])
        raise AssertionError(f"{what}: {int((~same).sum())} values differ, first at {idx}: "
                             f"got {got[idx].item()!r}, expected {expected[idx].item()!r}")


def delayed_scale(x: torch.Tensor, fmt: torch.dtype, margin: float = 1.0) -> torch.Tensor:
    """The per-tensor scale of FP8 training: the format's max over the tensor's amax."""
    return fp8.scalar(fp8.FP8_MAX[fmt] / (margin * float(x.float().abs().max())))


def dequantized64(q: fp8.Quantized, transposed: bool = False) -> torch.Tensor:
    data = q.data_t if transposed else q.data
    return data.float().double() * q.scale_inv.double()


def assert_gemm_close(got, ref64, abs_sum, k_dim, kind, what, extra_atol=None):
    u = UNIT_ROUNDOFF[got.dtype]
    g = got.double()
    assert torch.isfinite(g).all(), f"{what}: non-finite (unwritten?) at {torch.nonzero(~torch.isfinite(g))[:5].tolist()}"
    bound = u * ref64.abs() + ACCUMULATION[kind](k_dim) * abs_sum + 1e-30
    if extra_atol is not None:
        bound = bound + extra_atol
    excess = (g - ref64).abs() / bound
    worst = float(excess.max()) if excess.numel() else 0.0
    norm = float((g - ref64).norm() / ref64.norm().clamp_min(1e-30))
    print(f"{what}: worst error {worst:.3f} of the element bound, norm-wise {norm:.2e}")
    if worst > 1:
        idx = tuple(int(i) for i in torch.nonzero(excess == excess.max())[0])
        raise AssertionError(f"{what} [{kind}, {got.dtype}]: {int((excess > 1).sum())}/{g.numel()} out of "
                             f"tolerance, worst at {idx}: got {g[idx].item()}, expected {ref64[idx].item()}")
    assert norm <= NORM_ERROR[kind] + u, f"{what}: norm-wise relative error {norm:.3e}"


# --- quantisation ---------------------------------------------------------------------------

CAST_SHAPES = [(1, 16), (7, 48), (5, 13), (130, 250), (257, 129), (33, 4112), (4097, 4096), (8192, 11008)]


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=INPUT_IDS)
@pytest.mark.parametrize("shape", CAST_SHAPES, ids=str)
def test_quantize_cast_transpose_amax(k, shape, dtype, fmt):
    # 2 sigma of randn beyond the scale's limit: about 5% of the values saturate, the rest spread
    # over the normal and subnormal ranges; the scale is not a power of two, so x * scale rounds.
    x = (torch.randn(shape, device="cuda") * 2).to(dtype)
    scale = fp8.scalar(fp8.FP8_MAX[fmt] / 4.0 * 0.917)
    q = k.quantize(x, fmt, scale)
    expected = quantize_ref(x, scale, fmt)
    assert_bytes_equal(q.data, expected, "row-wise")
    assert_bytes_equal(q.data_t, expected.t(), "transposed")
    assert q.amax.item() == x.float().abs().max().item(), "amax is exact"
    assert q.scale_inv.item() == (1.0 / scale).item(), "scale_inv is 1/scale correctly rounded"
    saturated = (x.float() * scale).abs() > fp8.FP8_MAX[fmt]
    if shape[0] * shape[1] > 10000:
        assert saturated.any(), "the test scale should make some values saturate"


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_quantize_rounds_to_nearest_even_and_saturates(k, fmt):
    """Against an independent float64 reference: every finite FP8 value, every midpoint between
    neighbours (exact ties: the even code wins), one fp32 ulp either side of each midpoint, and
    values beyond the largest finite one (saturate)."""
    codes = torch.arange(0, 128, dtype=torch.int64, device="cuda")
    values = codes.to(torch.uint8).view(fmt).float().double()
    finite = torch.isfinite(values)
    values, codes = values[finite], codes[finite]
    mids = ((values[1:] + values[:-1]) / 2).float()
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, math.inf))
    top = values[-1].item()
    beyond = torch.tensor([top * 1.01, top * 1.5, top * 1e3, 1e30, 3.4e38], device="cuda")
    y = torch.cat([values.float(), mids, below, above, beyond])
    y = torch.cat([y, -y])
    y = torch.cat([y, torch.zeros(16 - y.numel() % 16, device="cuda")])  # whole 16-byte segments

    mag = y.double().abs()
    hi = torch.searchsorted(values, mag).clamp(max=values.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0)) | (values[hi] == mag)
    code = torch.where(pick_hi, codes[hi], codes[lo])
    code = torch.where(mag > top, codes[-1], code)
    code = code | torch.where(y < 0, 0x80, 0)
    expected = fold_zero(code.to(torch.uint8))

    x = y.reshape(1, -1)
    q = k.quantize(x, fmt, scale=None, transpose=False)
    assert_bytes_equal(q.data.reshape(-1), expected, "round to nearest even")
    assert_bytes_equal(q.data, quantize_ref(x, None, fmt), "torch's conversion of the clamped value")
    assert q.scale_inv.item() == 1.0


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=INPUT_IDS)
def test_quantize_nan_inf_follow_the_formats(k, dtype, fmt):
    inf, nan = math.inf, math.nan
    big = 3.0e38 if dtype is torch.float32 else (6.0e4 if dtype is torch.float16 else 3.0e38)
    specials = [nan, inf, -inf, big, -big, 0.0, -0.0, 1.0, -1.0, -nan]
    x = torch.tensor(specials + [0.5] * (32 - len(specials)), device="cuda").to(dtype).reshape(2, 16)
    scale = fp8.scalar(2.0)
    q = k.quantize(x, fmt, scale)
    limit = 0x7E if fmt is E4M3 else 0x7B
    inf_code = (0x7F, 0x7F) if fmt is E4M3 else (0x7C, 0xFC)
    head = fold_zero(q.data.view(torch.uint8).reshape(-1)[: len(specials)]).tolist()
    one = int(torch.tensor([2.0]).to(fmt).view(torch.uint8))
    assert head == [0x7F, inf_code[0], inf_code[1], limit, 0x80 | limit, 0, 0, one, 0x80 | one, 0x7F]
    assert_bytes_equal(q.data, quantize_ref(x, scale, fmt), "specials vs reference")
    assert_bytes_equal(q.data_t, quantize_ref(x, scale, fmt).t(), "specials transposed")
    assert math.isnan(q.amax.item()), "a NaN input makes amax NaN"

    no_nan = torch.nan_to_num(x.float(), nan=0.0, posinf=inf, neginf=-inf).to(dtype)
    assert k.quantize(no_nan, fmt, scale).amax.item() == inf, "an Inf input makes amax Inf"

    nan_scale = k.quantize(x, fmt, fp8.scalar(nan))
    codes = nan_scale.data.view(torch.uint8)
    finite_in = torch.isfinite(x.float())
    assert (codes[finite_in] == 0x7F).all(), "a NaN scale makes every finite value NaN"


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_quantize_saturates_finite_values_whose_product_overflows_fp32(k, fmt):
    x = torch.tensor([[1e30, -1e30, 0.0, 1e-30] * 4], device="cuda")
    q = k.quantize(x, fmt, fp8.scalar(1e20), transpose=False)
    limit = 0x7E if fmt is E4M3 else 0x7B
    assert fold_zero(q.data.view(torch.uint8))[0, :4].tolist() == [limit, 0x80 | limit, 0, 0]


def test_quantize_rowwise_only_transpose_only_and_amax_only(k):
    x = torch.randn(300, 200, device="cuda").to(torch.bfloat16)
    scale = delayed_scale(x, E4M3)
    expected = quantize_ref(x, scale, E4M3)
    rowwise = k.quantize(x, E4M3, scale, transpose=False)
    assert rowwise.data_t is None
    assert_bytes_equal(rowwise.data, expected, "row-wise only")
    transposed = k.quantize(x, E4M3, scale, rowwise=False)
    assert transposed.data is None
    assert_bytes_equal(transposed.data_t, expected.t(), "transpose only")
    amax_only = k.quantize(x, E4M3, scale, rowwise=False, transpose=False)
    assert amax_only.amax.item() == x.float().abs().max().item()
    assert amax_only.scale_inv.item() == (1.0 / scale).item()


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=INPUT_IDS)
@pytest.mark.parametrize("shape", CAST_SHAPES, ids=str)
def test_quantize_amax_only_is_exact_on_every_shape(k, shape, dtype):
    """The amax-only pass (current scaling's first pass; a flat kernel for contiguous x): exact,
    with the largest magnitude planted in the last element (the partial last segment), the first,
    and at an element offset that makes the view misaligned (the scalar load path)."""
    x = torch.randn(shape, device="cuda").to(dtype)
    scale = fp8.scalar(3.0)
    for where in (-1, 0):
        planted = x.clone().reshape(-1)
        planted[where] = -100.0
        q = k.quantize(planted.reshape(shape), E4M3, scale, rowwise=False, transpose=False)
        assert q.data is None and q.data_t is None
        assert q.amax.item() == 100.0, f"amax with the max at element {where}"
        assert q.scale_inv.item() == (1.0 / scale).item()
    base = torch.randn(shape[0] * shape[1] + 1, device="cuda").to(dtype)
    view = base[1:].view(shape)  # contiguous, one element past an aligned start
    assert k.quantize(view, E4M3, rowwise=False, transpose=False).amax.item() == view.float().abs().max().item()


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=INPUT_IDS)
def test_quantize_amax_only_propagates_nan_and_inf(k, dtype):
    x = torch.randn(33, 4112, device="cuda").to(dtype)
    x.view(-1)[-3] = math.inf
    assert k.quantize(x, E5M2, rowwise=False, transpose=False).amax.item() == math.inf
    x.view(-1)[5] = math.nan
    assert math.isnan(k.quantize(x, E5M2, rowwise=False, transpose=False).amax.item())


def test_quantize_amax_only_of_a_row_strided_view_reads_only_its_elements(k):
    base = torch.randn(77, 200, device="cuda").to(torch.bfloat16)
    base[:, 160:] = 1000.0  # outside the view
    view = base[:, :160]
    assert k.quantize(view, E4M3, rowwise=False, transpose=False).amax.item() == view.float().abs().max().item()


def test_quantize_amax_accumulates(k):
    x1 = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    x2 = (torch.randn(64, 64, device="cuda") * 3).to(torch.bfloat16)
    amax = torch.zeros(1, device="cuda")
    k.quantize(x1, E4M3, amax=amax)
    k.quantize(x2, E4M3, amax=amax)
    assert amax.item() == max(x1.float().abs().max().item(), x2.float().abs().max().item())
    amax.fill_(1e6)
    k.quantize(x1, E4M3, amax=amax)
    assert amax.item() == 1e6


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_quantize_strided_and_unaligned_views_write_only_their_elements(k, fmt):
    """Row-strided views, 16-byte aligned (vector paths) and at odd offsets (scalar paths), as
    input and outputs; the outputs' padding must stay poisoned."""
    rows, cols = 77, 160
    base = torch.randn(rows, cols + 24, device="cuda").to(torch.bfloat16)
    scale = fp8.scalar(37.5)
    # (input column offset in elements, output and transposed-output column offsets in bytes)
    for x_off, out_off, out_t_off in ((0, 16, 16), (1, 8, 3)):
        x = base[:, x_off: x_off + cols]
        out_buf = fp8.empty((rows, cols + 32), fmt)
        out_t_buf = fp8.empty((cols, rows + 19), fmt)
        q = k.quantize(x, fmt, scale, out=out_buf[:, out_off: out_off + cols],
                       out_t=out_t_buf[:, out_t_off: out_t_off + rows])
        expected = quantize_ref(x, scale, fmt)
        assert_bytes_equal(q.data, expected, f"row-wise, offsets {x_off}/{out_off}")
        assert_bytes_equal(q.data_t, expected.t(), f"transposed, offset {out_t_off}")
        pads = [out_buf[:, :out_off], out_buf[:, out_off + cols:], out_t_buf[:, :out_t_off],
                out_t_buf[:, out_t_off + rows:]]
        for pad in pads:
            assert (pad.view(torch.uint8) == fp8.FP8_NAN_BYTE).all(), "wrote outside the output view"


def test_quantize_rejects_bad_arguments(k):
    x = torch.randn(32, 48, device="cuda").to(torch.bfloat16)
    q = fp8.empty((32, 48), E4M3)
    q_t = fp8.empty((48, 32), E4M3)
    scale = fp8.scalar(1.0)
    ok = fp8.describe(q, scale=scale)
    assert k.quantize_status(fp8.describe(x), ok, fp8.describe(q_t)) == 0
    assert k.quantize_status(fp8.describe(q), ok, fp8.describe(q_t)) == fp8.STATUS_INVALID_ARGUMENT  # FP8 x: no out
    assert k.quantize_status(fp8.describe(x), fp8.describe(x), fp8.describe(None, E4M3)) == fp8.STATUS_UNSUPPORTED_DTYPE
    assert k.quantize_status(fp8.describe(x), ok, fp8.describe(q)) == fp8.STATUS_INVALID_ARGUMENT  # not [cols, rows]
    assert k.lib.fastffn_last_error().decode().startswith("fastffn_fp8_quantize_cuda: out_t must be [")
    e5 = fp8.empty((48, 32), E5M2)
    assert k.quantize_status(fp8.describe(x), ok, fp8.describe(e5)) == fp8.STATUS_INVALID_ARGUMENT  # dtype mismatch
    aliased = fp8.describe(q, scale=scale, scale_inv=scale)
    assert k.quantize_status(fp8.describe(x), aliased, fp8.describe(q_t)) == fp8.STATUS_INVALID_ARGUMENT


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("shape", CAST_SHAPES, ids=str)
def test_transpose_of_an_fp8_copy_is_its_bytes_transposed(k, shape, fmt):
    """Every byte pattern (NaN and Inf codes included) at every shape: the tile walk's edges."""
    data = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(fmt)
    assert_bytes_equal(k.transpose(data), data.t(), "transposed")


def test_transpose_of_strided_views_writes_only_their_elements(k):
    base = torch.randint(0, 256, (77, 200), dtype=torch.uint8, device="cuda").view(E4M3)
    for col_off, out_off in ((0, 16), (3, 5)):
        data = base[:, col_off: col_off + 160]
        out_buf = fp8.empty((160, 77 + 24), E4M3)
        k.transpose(data, out_t=out_buf[:, out_off: out_off + 77])
        assert_bytes_equal(out_buf[:, out_off: out_off + 77], data.t(), f"offsets {col_off}/{out_off}")
        for pad in (out_buf[:, :out_off], out_buf[:, out_off + 77:]):
            assert (pad.view(torch.uint8) == fp8.FP8_NAN_BYTE).all(), "wrote outside the output view"


def test_transpose_of_an_fp8_copy_rejects_scaling_and_other_outputs(k):
    data = torch.randint(0, 256, (32, 48), dtype=torch.uint8, device="cuda").view(E4M3)
    out_t = fp8.empty((48, 32), E4M3)
    none = fp8.describe(None, E4M3, shape=(32, 48))
    assert k.quantize_status(fp8.describe(data), none, fp8.describe(out_t)) == 0
    scaled = fp8.describe(None, E4M3, scale=fp8.scalar(2.0), shape=(32, 48))
    assert k.quantize_status(fp8.describe(data), scaled, fp8.describe(out_t)) == fp8.STATUS_INVALID_ARGUMENT
    assert "transposed byte for byte into out_t" in k.lib.fastffn_last_error().decode()
    e5 = fp8.empty((48, 32), E5M2)
    assert k.quantize_status(fp8.describe(data), none, fp8.describe(e5)) == fp8.STATUS_INVALID_ARGUMENT
    assert k.quantize_status(fp8.describe(data), none, fp8.describe(None, E4M3, shape=(48, 32))) == \
        fp8.STATUS_INVALID_ARGUMENT
    square = torch.randint(0, 256, (32, 32), dtype=torch.uint8, device="cuda").view(E4M3)
    assert k.quantize_status(fp8.describe(square), fp8.describe(None, E4M3, shape=(32, 32)),
                             fp8.describe(square)) == fp8.STATUS_INVALID_ARGUMENT  # in place: would race
    assert "must not overlap x" in k.lib.fastffn_last_error().decode()


# --- dequantisation -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=INPUT_IDS)
def test_dequantize_every_code(k, dtype, fmt):
    codes = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    q = torch.cat([codes, codes.flip(0)]).reshape(32, 16).view(fmt)
    for scale_inv in (None, fp8.scalar(0.375), fp8.scalar(1024.0)):
        y = k.dequantize(q, scale_inv, dtype)
        ref = q.float() * (scale_inv if scale_inv is not None else 1.0)
        assert_same_floats(y, ref.to(dtype), f"dequantize {scale_inv}")


@pytest.mark.parametrize("shape", [(1, 16), (7, 13), (257, 4112), (4097, 4096)], ids=str)
def test_dequantize_round_trip(k, shape):
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    for fmt in FORMATS:
        scale = delayed_scale(x, fmt)
        q = k.quantize(x, fmt, scale)
        y = k.dequantize(q.data, q.scale_inv, torch.float32)
        y_t = k.dequantize(q.data_t, q.scale_inv, torch.float32)
        rel, sub = ROUND_TRIP[fmt]
        # 2^-20: slack for the fp32 products x * scale and q * scale_inv (2^-24 each).
        bound = (rel * x.float().abs() + sub / scale) * (1 + 2.0**-20)
        assert ((y - x.float()).abs() <= bound).all(), f"round trip [{fmt}]"
        assert torch.equal(y_t, y.t()), "the transposed copy dequantises to the transpose"


# --- GEMM -----------------------------------------------------------------------------------

def test_gemm_loads_cublaslt(k):
    version = k.gemm_init()
    with open("/proc/self/maps") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "libcublasLt" in line})
    print(f"cuBLASLt {version} from {loaded}")
    assert len(loaded) == 1, "one cuBLASLt in the process (the one torch loaded)"
    assert version >= 110800, "FP8 GEMMs need cuBLASLt 11.8 or newer"


GEMM_16BIT_SHAPES = [(1, 1, 1), (7, 13, 33), (64, 48, 80), (257, 384, 1000)]
LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]
LAYOUT_IDS = ["x@wT", "aT", "bT", "aT_bT"]


@contextlib.contextmanager
def fp32_split_k_sums():
    """By default torch lets cuBLAS keep split-K partial sums in 16 bits; ours never does."""
    matmul = torch.backends.cuda.matmul
    names = [n for n in ("allow_fp16_reduced_precision_reduction",
                         "allow_bf16_reduced_precision_reduction") if hasattr(matmul, n)]
    saved = [getattr(matmul, n) for n in names]
    for n in names:
        setattr(matmul, n, False)
    try:
        yield
    finally:
        for n, value in zip(names, saved):
            setattr(matmul, n, value)


def logical_operands(m, n, kk, dtype, transpose_a, transpose_b):
    """Logical A [M, K], B [N, K] and the stored a, b for the transpose flags."""
    a_log = torch.randn(m, kk, device="cuda").to(dtype)
    b_log = torch.randn(n, kk, device="cuda").to(dtype)
    a = a_log.t().contiguous() if transpose_a else a_log
    b = b_log.t().contiguous() if transpose_b else b_log
    return a_log, b_log, a, b


@pytest.mark.parametrize("out_same", [True, False], ids=["out16", "out32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("shape", GEMM_16BIT_SHAPES, ids=str)
def test_gemm_16bit(k, shape, layout, dtype, out_same):
    m, n, kk = shape
    a_log, b_log, a, b = logical_operands(m, n, kk, dtype, *layout)
    out_dtype = dtype if out_same else torch.float32
    got = k.gemm(a, b, out_dtype, transpose_a=layout[0], transpose_b=layout[1], alpha=0.75)
    ref = 0.75 * a_log.double() @ b_log.double().t()
    abs_sum = 0.75 * a_log.double().abs() @ b_log.double().abs().t()
    assert_gemm_close(got, ref, abs_sum, kk, "16bit", f"gemm {shape} {layout}")
    if out_same:  # torch's cuBLAS GEMM meets the same bound (the tolerance's own check)
        zeros = torch.zeros(m, n, device="cuda", dtype=dtype)
        with fp32_split_k_sums():
            torch_out = torch.addmm(zeros, a_log, b_log.t(), beta=0.0, alpha=0.75)
        assert_gemm_close(torch_out, ref, abs_sum, kk, "16bit", "torch.addmm")


def test_gemm_16bit_large_and_unaligned(k):
    m, n, kk = 2048, 4096, 4096
    x = torch.randn(m, kk, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, kk, device="cuda").to(torch.bfloat16)
    ref = x.double() @ w.double().t()
    abs_sum = x.double().abs() @ w.double().abs().t()
    assert_gemm_close(k.gemm(x, w), ref, abs_sum, kk, "16bit", "bf16 2048x4096x4096")
    # A 2-byte aligned view: the heuristic must be told (else it may pick a 16-byte kernel).
    base = torch.randn(65, 257, device="cuda").to(torch.bfloat16)
    a = base[:64, 1:]
    b = torch.randn(40, 256, device="cuda").to(torch.bfloat16)
    ref = a.double() @ b.double().t()
    assert_gemm_close(k.gemm(a, b), ref, a.double().abs() @ b.double().abs().t(), 256, "16bit", "unaligned view")


def test_gemm_accumulates_into_fp32(k):
    """wgrad accumulation: D += dy^T @ x in fp32, with dy and x in their stored [T, *] layout."""
    t, n_out, n_in = 384, 96, 160
    dy = torch.randn(t, n_out, device="cuda").to(torch.bfloat16)
    x = torch.randn(t, n_in, device="cuda").to(torch.bfloat16)
    d0 = torch.randn(n_out, n_in, device="cuda")
    d = d0.clone()
    k.gemm(dy, x, transpose_a=True, transpose_b=True, out=d, accumulate=True)
    ref = d0.double() + dy.double().t() @ x.double()
    abs_sum = dy.double().abs().t() @ x.double().abs()
    assert_gemm_close(d, ref, abs_sum, t, "16bit", "accumulate", extra_atol=2.0**-24 * d0.double().abs())


def test_gemm_empty_k_zeroes_or_keeps_the_output(k):
    a = torch.empty(5, 0, device="cuda", dtype=torch.bfloat16)
    b = torch.empty(7, 0, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(k.gemm(a, b, torch.float32), torch.zeros(5, 7, device="cuda"))
    d = torch.randn(5, 7, device="cuda")
    kept = d.clone()
    k.gemm(a, b, out=d, accumulate=True)
    assert torch.equal(d, kept)


def test_gemm_repeated_calls_reuse_the_cached_algorithm(k):
    x = torch.randn(96, 512, device="cuda").to(torch.bfloat16)
    w = torch.randn(256, 512, device="cuda").to(torch.bfloat16)
    assert torch.equal(k.gemm(x, w), k.gemm(x, w))


def quantized_pair(k, m, n, kk, fmt_a=E4M3, fmt_b=E4M3):
    x = torch.randn(m, kk, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, kk, device="cuda") * 0.05).to(torch.bfloat16)
    return k.quantize(x, fmt_a, delayed_scale(x, fmt_a)), k.quantize(w, fmt_b, delayed_scale(w, fmt_b))


FP8_SHAPES = [(16, 16, 16), (7, 48, 64), (1000, 1024, 4096), (4096, 4096, 4096)]


@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast_accum"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=str)
def test_fp8_gemm_forward(k, shape, out_dtype, fast_accum):
    """y = x @ w^T, e4m3 x e4m3, per-tensor scales, vs the float64 GEMM of the dequantised inputs."""
    m, n, kk = shape
    xq, wq = quantized_pair(k, m, n, kk)
    got = k.gemm_q(xq, wq, out_dtype, fast_accum=fast_accum)
    a64, b64 = dequantized64(xq), dequantized64(wq)
    kind = "fp8_fast" if fast_accum else "fp8"
    assert_gemm_close(got, a64 @ b64.t(), a64.abs() @ b64.abs().t(), kk, kind, f"fp8 fwd {shape}")


@pytest.mark.parametrize("shape", [(256, 512, 384), (2048, 4096, 11008)], ids=str)
def test_fp8_linear_backward_uses_the_transposed_copies(k, shape):
    """dgrad dx = dy @ w with dy e5m2 and w^T e4m3; wgrad dw += dy^T @ x from the transposed copies
    (the TN-only rule), accumulated in fp32."""
    t, n_in, n_out = shape
    x = torch.randn(t, n_in, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n_out, n_in, device="cuda") * 0.02).to(torch.bfloat16)
    dy = (torch.randn(t, n_out, device="cuda") * 1e-3).to(torch.bfloat16)
    xq = k.quantize(x, E4M3, delayed_scale(x, E4M3))
    wq = k.quantize(w, E4M3, delayed_scale(w, E4M3))
    dyq = k.quantize(dy, E5M2, delayed_scale(dy, E5M2))

    dx = k.gemm_q(dyq, wq, torch.bfloat16, b_t=True)  # [t, in] = dy [t, out] @ (w^T [in, out])^T
    dy64, w64, x64 = dequantized64(dyq), dequantized64(wq), dequantized64(xq)
    assert_gemm_close(dx, dy64 @ w64, dy64.abs() @ w64.abs(), n_out, "fp8", "dgrad e5m2 x e4m3")

    dw0 = torch.randn(n_out, n_in, device="cuda") * 1e-3
    dw = dw0.clone()
    k.gemm_q(dyq, xq, a_t=True, b_t=True, out=dw, accumulate=True)  # [out, in] += dy^T @ x
    ref = dw0.double() + dy64.t() @ x64
    assert_gemm_close(dw, ref, dy64.abs().t() @ x64.abs(), t, "fp8", "wgrad accumulate",
                      extra_atol=2.0**-24 * dw0.double().abs())


@contextlib.contextmanager
def gemm_tuning(k, candidates):
    """The process-wide GEMM tuning set for the block, restored after."""
    saved = k.gemm_tuning
    k.gemm_tuning = candidates
    try:
        yield
    finally:
        k.gemm_tuning = saved


def new_records(k, before):
    return k.gemm_tuning_records()[before:]


@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast_accum"])
def test_tuned_fp8_gemm_times_candidates_and_meets_the_tolerance(k, fast_accum):
    """With tuning on, a new problem's candidates are timed and the winner's result meets the
    same bound as the heuristic's first choice; its record says what ran."""
    m, n, kk = 1040, 2064, 4096  # a shape no other test uses: a new problem for the cache
    xq, wq = quantized_pair(k, m, n, kk)
    before = len(k.gemm_tuning_records())
    with gemm_tuning(k, 8):
        got = k.gemm_q(xq, wq, torch.bfloat16, fast_accum=fast_accum)
        again = k.gemm_q(xq, wq, torch.bfloat16, fast_accum=fast_accum)
    records = new_records(k, before)
    assert len(records) == 1, "one record per new problem; the second call reuses the cached winner"
    record = records[0]
    print(record)
    assert (record["m"], record["n"], record["k"]) == (m, n, kk)
    assert record["dtypes"] == ["float8_e4m3fn", "float8_e4m3fn", "bfloat16"]
    assert record["fast_accum"] is fast_accum and not record["accumulate"]
    assert record["candidates_asked"] == 8 and record["candidates_timed"] >= 1
    assert 0 <= record["chosen_rank"] < record["candidates_asked"]
    assert 0 < record["chosen_ms"] <= record["first_choice_ms"]
    for config in (record["first_choice_config"], record["chosen_config"]):
        assert set(config) == set(fp8.ALGO_CONFIG_FIELDS) and (config["split_k"] == -1 or config["split_k"] >= 1)
    assert torch.equal(got, again)
    a64, b64 = dequantized64(xq), dequantized64(wq)
    kind = "fp8_fast" if fast_accum else "fp8"
    assert_gemm_close(got, a64 @ b64.t(), a64.abs() @ b64.abs().t(), kk, kind, "tuned fp8 fwd")


def test_tuned_accumulating_gemm_adds_once(k):
    """The timed runs of an accumulating GEMM write a scratch D: D receives the product once."""
    t, n_out, n_in = 4096, 1008, 2064
    dy = torch.randn(t, n_out, device="cuda").to(torch.bfloat16)
    x = torch.randn(t, n_in, device="cuda").to(torch.bfloat16)
    dyq, xq = k.quantize(dy, E5M2, delayed_scale(dy, E5M2)), k.quantize(x, E4M3, delayed_scale(x, E4M3))
    d0 = torch.randn(n_out, n_in, device="cuda")
    d = d0.clone()
    before = len(k.gemm_tuning_records())
    with gemm_tuning(k, 8):
        k.gemm_q(dyq, xq, a_t=True, b_t=True, out=d, accumulate=True)
    [record] = new_records(k, before)
    assert record["accumulate"] and record["candidates_timed"] >= 1
    dy64, x64 = dequantized64(dyq), dequantized64(xq)
    ref = d0.double() + dy64.t() @ x64
    assert_gemm_close(d, ref, dy64.abs().t() @ x64.abs(), t, "fp8", "tuned wgrad accumulate",
                      extra_atol=2.0**-24 * d0.double().abs())


def test_tuning_is_part_of_the_cached_problem(k):
    """A problem first run untuned is tuned when tuning is switched on (the cache key holds the
    setting), and switching it off again runs the heuristic's choice without a new record."""
    x = torch.randn(208, 768, device="cuda").to(torch.bfloat16)
    w = torch.randn(400, 768, device="cuda").to(torch.bfloat16)
    with gemm_tuning(k, 0):
        untuned = k.gemm(x, w)
    before = len(k.gemm_tuning_records())
    with gemm_tuning(k, 4):
        tuned = k.gemm(x, w)
    assert len(new_records(k, before)) == 1
    with gemm_tuning(k, 0):
        assert torch.equal(k.gemm(x, w), untuned)
    assert len(new_records(k, before)) == 1
    ref = x.double() @ w.double().t()
    assert_gemm_close(tuned, ref, x.double().abs() @ w.double().abs().t(), 768, "16bit", "tuned bf16")


@pytest.mark.parametrize("candidates", [-1, 33])
def test_gemm_tuning_rejects_out_of_range_candidates(k, candidates):
    saved = k.gemm_tuning
    with pytest.raises(fp8.Fp8Error, match="candidates must be 0 or 1 .* or 2..32, got"):
        k.gemm_tuning = candidates
    assert k.gemm_tuning == saved


@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast_accum"])
def test_fp8_gemm_matches_torch_scaled_mm(k, fast_accum):
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("torch._scaled_mm not available")
    m, n, kk = 1024, 2048, 4096
    xq, wq = quantized_pair(k, m, n, kk)
    ours = k.gemm_q(xq, wq, torch.bfloat16, fast_accum=fast_accum)
    theirs = torch._scaled_mm(xq.data, wq.data.t(), scale_a=xq.scale_inv.reshape(()),
                              scale_b=wq.scale_inv.reshape(()), out_dtype=torch.bfloat16,
                              use_fast_accum=fast_accum)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    print(f"bit-identical to torch._scaled_mm: {torch.equal(ours, theirs)}")
    a64, b64 = dequantized64(xq), dequantized64(wq)
    ref, abs_sum = a64 @ b64.t(), a64.abs() @ b64.abs().t()
    kind = "fp8_fast" if fast_accum else "fp8"
    assert_gemm_close(theirs, ref, abs_sum, kk, kind, "torch._scaled_mm (same tolerance)")
    # Ours against theirs: both within the bound of the reference, so within twice of each other.
    bound = 2 * (UNIT_ROUNDOFF[torch.bfloat16] * ref.abs() + ACCUMULATION[kind](kk) * abs_sum)
    assert ((ours.double() - theirs.double()).abs() <= bound).all()


def test_fp8_gemm_rejects_what_cublaslt_cannot_do(k):
    xq, wq = quantized_pair(k, 32, 48, 64)
    with pytest.raises(fp8.Fp8Error, match="K-major") as error:  # FP8 is TN-only
        k.gemm(xq.data, wq.data_t, a_scale_inv=xq.scale_inv, b_scale_inv=wq.scale_inv, transpose_b=True)
    assert error.value.status == fp8.STATUS_INVALID_ARGUMENT
    with pytest.raises(fp8.Fp8Error) as error:
        k.gemm(xq.data_t, wq.data, transpose_a=True)
    assert error.value.status == fp8.STATUS_INVALID_ARGUMENT
    x40, w40 = quantized_pair(k, 32, 48, 40)  # K % 16 != 0
    with pytest.raises(fp8.Fp8Error, match="K % 16") as error:
        k.gemm_q(x40, w40)
    assert error.value.status == fp8.STATUS_INVALID_ARGUMENT
    e5x, e5w = quantized_pair(k, 32, 48, 64, E5M2, E5M2)
    with pytest.raises(fp8.Fp8Error, match="E5M2 x E5M2") as error:
        k.gemm_q(e5x, e5w)
    assert error.value.status == fp8.STATUS_UNSUPPORTED_DTYPE
    shifted = fp8.empty((32 * 64 + 8,), E4M3)[8:].view(32, 64)  # 8-byte aligned
    shifted.copy_(xq.data)
    with pytest.raises(fp8.Fp8Error, match="aligned") as error:
        k.gemm(shifted, wq.data)
    assert error.value.status == fp8.STATUS_INVALID_ARGUMENT
    bf = torch.randn(32, 64, device="cuda").to(torch.bfloat16)
    with pytest.raises(fp8.Fp8Error, match="scale_inv") as error:
        k.gemm(bf, bf, a_scale_inv=fp8.scalar(1.0))
    assert error.value.status == fp8.STATUS_INVALID_ARGUMENT
