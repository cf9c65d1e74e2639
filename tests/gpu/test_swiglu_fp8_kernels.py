"""SwiGLU fused with FP8 quantisation (fastffn_swiglu_fwd_fp8_cuda / _bwd_fp8_cuda), the device
scale updates (fastffn_fp8_compute_scale_cuda, fastffn_fp8_update_amax_history_cuda) and the FP8
FFN composed from them (paddle_fastffn/torch/fp8/ffn.py), through the ctypes harness.

References: the fused kernels against the unfused fp32 SwiGLU kernels of swiglu.cu (the same fp32
expressions) followed by test_fp8_kernels' exact quantisation reference, bit for bit; against
float64 SwiGLU math within the kernels' fp32 evaluation error (swiglu_ref64); the scale kernels
against Transformer Engine's formulas in numpy float32; the FFN stage by stage (each quantisation
bit for bit, each GEMM against the float64 GEMM of its dequantised FP8 operands) and end to end
against an fp32 FFN within the FP8 error budget below. Outputs are poisoned before every call
(NaN; FP8: the NaN byte 0x7F)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fp8_kernels import (  # noqa: E402  the FP8 references, reused
    E4M3, E5M2, FORMAT_IDS, FORMATS, assert_bytes_equal, assert_gemm_close, assert_same_floats,
    dequantized64, fold_zero, quantize_ref)

from fp8_ffn_budget import FP8_FFN_BUDGET  # noqa: E402  (tests/, on the path by tests/conftest.py)

from paddle_fastffn.torch import c_api  # noqa: E402
from paddle_fastffn.torch import ops  # noqa: E402
from paddle_fastffn.torch.fp8 import ffn as fp8_ffn  # noqa: E402
from paddle_fastffn.torch.fp8 import c_api as fp8  # noqa: E402


@pytest.fixture(scope="module")
def k():
    return fp8.kernels()


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
# (T, I): one row, widths that are not a multiple of 16 (partial segments) or of 8 (the up half
# unaligned: scalar loads), partial tiles, the FFN test shapes (T = 1000: transposed rows of 1000
# bytes, element stores) and a LLaMA-7B intermediate.
SHAPES = [(1, 16), (7, 48), (5, 13), (130, 250), (257, 129), (64, 688), (1000, 1376), (2048, 11008)]

# --- the kernels' fp32 evaluation error, against float64 -----------------------------------------
# The kernels compute sigmoid(g) = __fdividef(1, 1 + __expf(-g)) (--use_fast_math). One fp32 ulp
# is at most 2^-23 relative. __expf(x) is within 2 + 1.173 |x| ulp (CUDA Math API, intrinsics);
# 1 + e^-g passes that error on damped by e^-g / (1 + e^-g) <= 1 and adds half an ulp; __fdividef
# adds 2 ulp: sigmoid within (4.5 + 1.173 |g|) ulp. Each product adds half an ulp. d_gate's factor
# t = 1 + g (1 - sig) cancels near g = -1.28 (where silu' = 0), so its bound is absolute there:
# |g| * abs_err(sig) plus an ulp of each term. Bounds are 2x these first-order sums, plus 2^-126
# for results flushed to zero.
ULP = 2.0**-23


def sigmoid_error(g64: torch.Tensor) -> torch.Tensor:
    return (4.5 + 1.173 * g64.abs()) * ULP


def swiglu_ref64(gate_up: torch.Tensor, d_h: torch.Tensor | None = None):
    """float64 h (and d_gate_up = [d_gate | d_up]) with per-element bounds of the kernels' fp32
    evaluation error: (h, h_err) or (h, h_err, d_gu, d_gu_err)."""
    i = gate_up.shape[1] // 2
    g, u = gate_up[:, :i].double(), gate_up[:, i:].double()
    sig = torch.sigmoid(g)
    r_sig = sigmoid_error(g)
    silu = g * sig
    h = silu * u
    h_err = 2 * h.abs() * (r_sig + 2 * ULP) + 2.0**-126
    if d_h is None:
        return h, h_err
    dy = d_h.double()
    a_sig = sig * r_sig
    one_minus = 1 - sig
    t = 1 + g * one_minus
    a_t = g.abs() * (a_sig + ULP * one_minus) + ULP * ((g * one_minus).abs() + t.abs())
    dg = dy * u * sig * t
    dg_err = 2 * ((dy * u).abs() * (sig * a_t + t.abs() * a_sig) + 3 * ULP * dg.abs()) + 2.0**-126
    du = dy * silu
    du_err = 2 * du.abs() * (r_sig + 2 * ULP) + 2.0**-126
    return h, h_err, torch.cat([dg, du], 1), torch.cat([dg_err, du_err], 1)


def assert_within_fp32_evaluation(got: torch.Tensor, value64, err64, scale, fmt, what: str):
    """Every FP8 value is the quantisation of some value within err64 of the exact value64:
    quantisation is monotone, so it lies between the quantisations of value64 -+ err64. Nearly all
    bytes are the code of value64 itself (the bracket straddles a rounding boundary rarely)."""
    lo = quantize_ref(value64 - err64, scale, fmt).view(fmt).float()
    hi = quantize_ref(value64 + err64, scale, fmt).view(fmt).float()
    g = got.float()
    bad = ~((g >= lo) & (g <= hi))
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())}/{g.numel()} outside the fp32 evaluation bracket, first "
                             f"at {idx}: got {g[idx].item()}, bracket [{lo[idx].item()}, {hi[idx].item()}] "
                             f"(float64 value {value64[idx].item() * scale.item()} scaled)")
    differs = int((fold_zero(got.view(torch.uint8)) != quantize_ref(value64, scale, fmt)).sum())
    print(f"{what}: {differs}/{g.numel()} bytes differ from the code of the float64 value")
    assert differs <= max(4, g.numel() * 2.0**-10), f"{what}: too many codes off the float64 value's"


def assert_amax_within(amax: float, value64, err64, what: str):
    lo, hi = float((value64.abs() - err64).max()), float((value64.abs() + err64).max())
    assert lo <= amax <= hi, f"{what}: amax {amax} outside [{lo}, {hi}]"


def unfused_fwd32(gate_up: torch.Tensor) -> torch.Tensor:
    """h by swiglu.cu's fp32 kernel on the exactly upcast input: the fused kernels' fp32 values."""
    return c_api.kernels().swiglu_fwd(gate_up.float().contiguous())


def unfused_bwd32(gate_up: torch.Tensor, d_h: torch.Tensor):
    """(d_gate_up, h) by swiglu.cu's fp32 backward kernel (recompute on)."""
    return c_api.kernels().swiglu_bwd(gate_up.float().contiguous(), d_h.float().contiguous(),
                                        recompute=True)


def scale_near(ref32: torch.Tensor, fmt, overshoot: float) -> torch.Tensor:
    """A scale that maps amax to `overshoot` x the format's max: the largest values saturate, and
    the factor is not a power of two (products round)."""
    return fp8.scalar(fp8.FP8_MAX[fmt] / float(ref32.abs().max()) * overshoot)


def gate_up_and_d_h(t, i, dtype):
    gate_up = (torch.randn(t, 2 * i, device="cuda") * 2).to(dtype)
    d_h = torch.randn(t, i, device="cuda").to(dtype)
    return gate_up, d_h


# --- forward ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_fwd_fp8_is_silu_mul_then_exact_quantise(k, shape, dtype, fmt):
    t, i = shape
    gate_up, _ = gate_up_and_d_h(t, i, dtype)
    h32 = unfused_fwd32(gate_up)
    scale = scale_near(h32, fmt, 1.7)
    q = k.swiglu_fwd_fp8(gate_up, fmt, scale, transpose=True)
    expected = quantize_ref(h32, scale, fmt)
    assert_bytes_equal(q.data, expected, "row-wise vs unfused + quantise")
    assert_bytes_equal(q.data_t, expected.t(), "transposed")
    assert q.amax.item() == h32.abs().max().item(), "amax is max |h| of the fp32 h, exactly"
    assert q.scale_inv.item() == (1.0 / scale).item()
    h64, h_err = swiglu_ref64(gate_up)
    assert_within_fp32_evaluation(q.data, h64, h_err, scale, fmt, f"h vs float64 {shape}")
    assert_amax_within(q.amax.item(), h64, h_err, "amax vs float64")


def test_swiglu_fwd_fp8_amax_only_pass_reads_and_writes_nothing_else(k):
    t, i = 300, 200
    gate_up, _ = gate_up_and_d_h(t, i, torch.bfloat16)
    amax = torch.zeros(1, device="cuda")
    scale = fp8.scalar(math.nan)   # not read
    scale_inv = fp8.scalar(7.0)    # not written
    status = k.raw_status("swiglu_fwd_fp8_cuda", fp8.describe(gate_up),
                          fp8.describe(None, E4M3, scale, scale_inv, amax, (t, i)),
                          fp8.describe(None, E4M3, shape=(i, t)), fp8.describe(None, E4M3))
    assert status == 0
    assert amax.item() == unfused_fwd32(gate_up).abs().max().item()
    assert scale_inv.item() == 7.0


# --- the forward's FP8 copy of gate_up, and the backward reading it ----------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_fwd_fp8_gate_up_copy_is_the_exact_quantisation_of_gate_up(k, shape, dtype, fmt):
    t, i = shape
    gate_up, _ = gate_up_and_d_h(t, i, dtype)
    h32 = unfused_fwd32(gate_up)
    scale, gu_scale = scale_near(h32, fmt, 1.7), scale_near(gate_up.float(), fmt, 1.3)
    gu_amax = torch.zeros(1, device="cuda")
    q, q_gu = k.swiglu_fwd_fp8_with_gate_up(gate_up, fmt, scale, transpose=True, gate_up_scale=gu_scale,
                                            gate_up_rowwise=True, gate_up_amax=gu_amax)
    assert_bytes_equal(q_gu.data, quantize_ref(gate_up.float(), gu_scale, fmt), "q(gate_up) vs quantise")
    assert gu_amax.item() == gate_up.float().abs().max().item(), "gate_up amax, exactly"
    assert q_gu.scale_inv.item() == (1.0 / gu_scale).item()
    expected = quantize_ref(h32, scale, fmt)  # h is the plain pass's: from the 16-bit gate_up
    assert_bytes_equal(q.data, expected, "h beside the gate_up copy")
    assert_bytes_equal(q.data_t, expected.t(), "h^T beside the gate_up copy")
    assert q.amax.item() == h32.abs().max().item()


def test_swiglu_fwd_fp8_amax_only_pass_gives_both_amaxes_and_a_strided_copy(k):
    rows, inter = 77, 160
    base = (torch.randn(rows, 2 * inter + 24, device="cuda") * 2).to(torch.bfloat16)
    gate_up = base[:, 1: 1 + 2 * inter]  # unaligned input rows: element loads
    h_amax, gu_amax = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    _, amax_only = k.swiglu_fwd_fp8_with_gate_up(gate_up, E4M3, rowwise=False, amax=h_amax,
                                                 gate_up_amax=gu_amax)
    assert amax_only.data is None and amax_only.scale_inv is None
    assert h_amax.item() == unfused_fwd32(gate_up).abs().max().item()
    assert gu_amax.item() == gate_up.float().abs().max().item()
    # Named: a temporary's memory could be handed to the next one, and aliased scalars are refused.
    gu_scale, gu_scale_inv, h_scale = fp8.scalar(37.5), fp8.scalar(0.0), fp8.scalar(1.0)
    out = fp8.empty((rows, 2 * inter + 48), E4M3)
    for off in (16, 5):  # a 16-byte aligned and an unaligned output view (byte stores)
        view = out[:, off: off + 2 * inter]
        status = k.raw_status("swiglu_fwd_fp8_cuda", fp8.describe(gate_up),
                              fp8.describe(None, E4M3, h_scale, shape=(rows, inter)),
                              fp8.describe(None, E4M3, shape=(inter, rows)),
                              fp8.describe(view, scale=gu_scale, scale_inv=gu_scale_inv))
        assert status == 0
        assert_bytes_equal(view, quantize_ref(gate_up.float(), gu_scale, E4M3), f"strided copy at {off}")
        outside = torch.cat([out[:, :off], out[:, off + 2 * inter:]], 1)
        assert (outside.view(torch.uint8) == fp8.FP8_NAN_BYTE).all(), "wrote outside the view"
        out.view(torch.uint8).fill_(fp8.FP8_NAN_BYTE)


def dequantized32(q: fp8.Quantized) -> torch.Tensor:
    """float(q) * scale_inv in fp32: the kernels' reading of an FP8 tensor."""
    return q.data.float() * q.scale_inv


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 16), (5, 13), (257, 129), (1000, 1376)], ids=str)
def test_swiglu_bwd_fp8_from_the_fp8_gate_up_is_the_backward_of_its_dequantised_values(k, shape, dtype, fmt):
    """d_h in 16/32 bits, gate_up as the forward's FP8 copy: every output is the unfused fp32
    backward of float(q(gate_up)) * scale_inv, quantised, bit for bit."""
    t, i = shape
    gate_up, d_h = gate_up_and_d_h(t, i, dtype)
    _, q_gu = k.swiglu_fwd_fp8_with_gate_up(gate_up, fmt, fp8.scalar(1.0), rowwise=False,
                                            gate_up_scale=scale_near(gate_up.float(), fmt, 1.2),
                                            gate_up_rowwise=True)
    gu32 = dequantized32(q_gu)
    d_gu32, h32 = unfused_bwd32(gu32, d_h)
    d_scale, h_scale = scale_near(d_gu32, E5M2, 1.7), scale_near(h32, fmt, 1.3)
    h_amax = torch.zeros(1, device="cuda")
    q, qh = k.swiglu_bwd_fp8(q_gu.data, d_h, E5M2, d_scale, h=fmt, h_scale=h_scale, h_rowwise=True,
                             h_transpose=True, h_amax=h_amax, gate_up_scale_inv=q_gu.scale_inv)
    expected = quantize_ref(d_gu32, d_scale, E5M2)
    assert_bytes_equal(q.data, expected, "d_gate_up from q(gate_up)")
    assert_bytes_equal(q.data_t, expected.t(), "d_gate_up^T from q(gate_up)")
    assert_bytes_equal(qh.data, quantize_ref(h32, h_scale, fmt), "recomputed h from q(gate_up)")
    assert_bytes_equal(qh.data_t, quantize_ref(h32, h_scale, fmt).t(), "recomputed h^T from q(gate_up)")
    assert q.amax.item() == d_gu32.abs().max().item() and h_amax.item() == h32.abs().max().item()
    _, h16 = k.swiglu_bwd_fp8(q_gu.data, d_h, E5M2, d_scale, rowwise=False, h=dtype,
                              gate_up_scale_inv=q_gu.scale_inv)
    assert h16.dtype == dtype
    assert_same_floats(h16, h32.to(dtype), "recomputed h in d_h's dtype from q(gate_up)")


def test_swiglu_bwd_fp8_from_the_fp8_gate_up_keeps_nan_and_inf(k):
    """Specials through the copy: NaN stays NaN; Inf is NaN in e4m3 (no Inf), Inf in e5m2."""
    gate_up = special_gate_up(torch.bfloat16)
    d_h = torch.ones(2, 16, device="cuda").to(torch.bfloat16)
    for fmt in FORMATS:
        _, q_gu = k.swiglu_fwd_fp8_with_gate_up(gate_up, fmt, fp8.scalar(1.0), rowwise=False,
                                                gate_up_scale=fp8.scalar(2.0), gate_up_rowwise=True)
        assert_bytes_equal(q_gu.data, quantize_ref(gate_up.float(), fp8.scalar(2.0), fmt), "specials copied")
        d_gu32, h32 = unfused_bwd32(dequantized32(q_gu), d_h)
        q, qh = k.swiglu_bwd_fp8(q_gu.data, d_h, E5M2, fp8.scalar(2.0), h=fmt, h_scale=fp8.scalar(2.0),
                                 h_rowwise=True, gate_up_scale_inv=q_gu.scale_inv)
        assert_bytes_equal(q.data, quantize_ref(d_gu32, fp8.scalar(2.0), E5M2), f"{fmt}: d_gate_up specials")
        assert_bytes_equal(qh.data, quantize_ref(h32, fp8.scalar(2.0), fmt), f"{fmt}: h specials")
        assert math.isnan(q.amax.item())


def test_swiglu_fwd_fp8_rowwise_only_and_transpose_only(k):
    gate_up, _ = gate_up_and_d_h(300, 200, torch.bfloat16)
    h32 = unfused_fwd32(gate_up)
    scale = scale_near(h32, E4M3, 1.2)
    expected = quantize_ref(h32, scale, E4M3)
    rowwise = k.swiglu_fwd_fp8(gate_up, E4M3, scale)
    assert rowwise.data_t is None
    assert_bytes_equal(rowwise.data, expected, "row-wise only")
    transposed = k.swiglu_fwd_fp8(gate_up, E4M3, scale, rowwise=False, transpose=True)
    assert transposed.data is None
    assert_bytes_equal(transposed.data_t, expected.t(), "transpose only")
    amax_only = k.swiglu_fwd_fp8(gate_up, E4M3, rowwise=False)
    assert amax_only.amax.item() == h32.abs().max().item() and amax_only.scale_inv is None


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_swiglu_fwd_fp8_strided_and_unaligned_views_write_only_their_elements(k, fmt):
    rows, inter = 77, 160
    base = (torch.randn(rows, 2 * inter + 24, device="cuda") * 2).to(torch.bfloat16)
    scale = fp8.scalar(37.5)
    # (input column offset in elements, output and transposed-output column offsets in bytes)
    for x_off, out_off, out_t_off in ((0, 16, 16), (1, 8, 3)):
        gate_up = base[:, x_off: x_off + 2 * inter]
        out_buf = fp8.empty((rows, inter + 32), fmt)
        out_t_buf = fp8.empty((inter, rows + 19), fmt)
        q = k.swiglu_fwd_fp8(gate_up, fmt, scale, out=out_buf[:, out_off: out_off + inter],
                             out_t=out_t_buf[:, out_t_off: out_t_off + rows])
        expected = quantize_ref(unfused_fwd32(gate_up), scale, fmt)
        assert_bytes_equal(q.data, expected, f"row-wise, offsets {x_off}/{out_off}")
        assert_bytes_equal(q.data_t, expected.t(), f"transposed, offset {out_t_off}")
        for pad in (out_buf[:, :out_off], out_buf[:, out_off + inter:], out_t_buf[:, :out_t_off],
                    out_t_buf[:, out_t_off + rows:]):
            assert (pad.view(torch.uint8) == fp8.FP8_NAN_BYTE).all(), "wrote outside the output view"


def special_gate_up(dtype):
    """[2, 2 * 16]: (gate, up) pairs whose h is NaN, +-Inf, an fp32 overflow of finite inputs,
    or ordinary, then ordinary padding."""
    inf, nan = math.inf, math.nan
    big = 6.0e4 if dtype is torch.float16 else 3.0e38
    pairs = [(nan, 1.0), (1.0, nan), (inf, 1.0), (inf, -2.0), (-inf, 1.0), (inf, 0.0), (big, big),
             (big, -big), (0.0, inf), (20.0, 1.0), (-1.0, -0.0), (3.0, -2.5)]
    pairs += [(0.5, 1.5)] * (32 - len(pairs))
    gate = torch.tensor([p[0] for p in pairs], device="cuda").reshape(2, 16)
    up = torch.tensor([p[1] for p in pairs], device="cuda").reshape(2, 16)
    return torch.cat([gate, up], 1).to(dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_swiglu_fwd_fp8_nan_inf_follow_the_formats(k, dtype, fmt):
    gate_up = special_gate_up(dtype)
    h32 = unfused_fwd32(gate_up)
    scale = fp8.scalar(2.0)
    q = k.swiglu_fwd_fp8(gate_up, fmt, scale, transpose=True)
    assert_bytes_equal(q.data, quantize_ref(h32, scale, fmt), "specials vs unfused + quantise")
    assert_bytes_equal(q.data_t, quantize_ref(h32, scale, fmt).t(), "specials transposed")
    codes = fold_zero(q.data.view(torch.uint8)).reshape(-1).tolist()
    inf_codes = (0x7F, 0x7F) if fmt is E4M3 else (0x7C, 0xFC)
    assert codes[0] == codes[1] == 0x7F, "NaN gate or up -> NaN"
    assert (codes[2], codes[3]) == inf_codes, "+-Inf -> Inf (e5m2) / NaN (e4m3)"
    assert codes[4] == codes[5] == codes[8] == 0x7F, "silu(-inf) = -inf * 0, inf * 0, 0 * inf: NaN"
    if dtype is not torch.float16:  # 3e38^2 overflows fp32: Inf, not a saturated finite value
        assert (codes[6], codes[7]) == inf_codes
    assert math.isnan(q.amax.item()), "a NaN h makes amax NaN"
    finite = torch.nan_to_num(gate_up.float(), nan=0.5, posinf=math.inf, neginf=-math.inf).to(dtype)
    finite[0, 4:6] = 0.5
    finite[0, 16 + 8] = 0.5
    assert k.swiglu_fwd_fp8(finite, fmt, scale).amax.item() == math.inf, "an Inf h makes amax Inf"
    nan_scale = k.swiglu_fwd_fp8(gate_up, fmt, fp8.scalar(math.nan))
    finite_h = torch.isfinite(h32)
    assert (nan_scale.data.view(torch.uint8)[finite_h] == 0x7F).all(), "a NaN scale: every value NaN"


# --- backward ---------------------------------------------------------------------------------

def check_bwd_against_unfused(k, gate_up, d_h, d_fmt, h_fmt, what):
    d_gu32, h32 = unfused_bwd32(gate_up, d_h)
    d_scale = scale_near(d_gu32, d_fmt, 1.7)
    h_scale = scale_near(h32, h_fmt, 1.3)
    h_amax = torch.zeros(1, device="cuda")
    q, qh = k.swiglu_bwd_fp8(gate_up, d_h, d_fmt, d_scale, h=h_fmt, h_scale=h_scale, h_rowwise=True,
                             h_transpose=True, h_amax=h_amax)
    expected = quantize_ref(d_gu32, d_scale, d_fmt)
    assert_bytes_equal(q.data, expected, f"{what}: d_gate_up vs unfused + quantise")
    assert_bytes_equal(q.data_t, expected.t(), f"{what}: d_gate_up transposed")
    h_expected = quantize_ref(h32, h_scale, h_fmt)
    assert_bytes_equal(qh.data, h_expected, f"{what}: recomputed h")
    assert_bytes_equal(qh.data_t, h_expected.t(), f"{what}: recomputed h transposed")
    assert q.amax.item() == d_gu32.abs().max().item(), "d_gate_up amax, exactly"
    assert h_amax.item() == h32.abs().max().item(), "h amax, exactly"
    assert q.scale_inv.item() == (1.0 / d_scale).item() and qh.scale_inv.item() == (1.0 / h_scale).item()
    h64, h_err, d_gu64, d_gu_err = swiglu_ref64(gate_up, d_h)
    assert_within_fp32_evaluation(q.data, d_gu64, d_gu_err, d_scale, d_fmt, f"{what}: d_gate_up vs float64")
    assert_within_fp32_evaluation(qh.data, h64, h_err, h_scale, h_fmt, f"{what}: h vs float64")
    assert_amax_within(q.amax.item(), d_gu64, d_gu_err, "d_gate_up amax vs float64")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_bwd_fp8_is_the_unfused_backward_then_exact_quantise(k, shape, dtype):
    gate_up, d_h = gate_up_and_d_h(*shape, dtype)
    check_bwd_against_unfused(k, gate_up, d_h, E5M2, E4M3, f"{shape} {dtype}")


@pytest.mark.parametrize("formats", [(E4M3, E5M2), (E4M3, E4M3), (E5M2, E5M2)],
                         ids=["d_e4m3-h_e5m2", "d_e4m3-h_e4m3", "d_e5m2-h_e5m2"])
def test_swiglu_bwd_fp8_other_format_pairs(k, formats):
    gate_up, d_h = gate_up_and_d_h(130, 250, torch.bfloat16)
    check_bwd_against_unfused(k, gate_up, d_h, *formats, str(formats))


def test_swiglu_bwd_fp8_recomputes_the_bytes_the_forward_wrote(k):
    gate_up, d_h = gate_up_and_d_h(1000, 1376, torch.bfloat16)
    scale = scale_near(unfused_fwd32(gate_up), E4M3, 1.0)
    forward = k.swiglu_fwd_fp8(gate_up, E4M3, scale)
    _, recomputed = k.swiglu_bwd_fp8(gate_up, d_h, E5M2, fp8.scalar(1.0), rowwise=False, transpose=False,
                                     h=E4M3, h_scale=scale, h_rowwise=True, h_transpose=True)
    assert_bytes_equal(recomputed.data, forward.data, "recomputed q(h) = the forward's")
    assert_bytes_equal(recomputed.data_t, forward.data.t(), "recomputed q(h)^T = the forward's transposed")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_swiglu_bwd_fp8_high_precision_h_is_the_unfused_recompute(k, dtype):
    gate_up, d_h = gate_up_and_d_h(257, 129, dtype)
    _, hidden = c_api.kernels().swiglu_bwd(gate_up, d_h, recompute=True)
    q, h = k.swiglu_bwd_fp8(gate_up, d_h, E5M2, fp8.scalar(1.0), h=dtype)
    assert h.dtype == dtype
    assert_same_floats(h, hidden, "recomputed h in the input dtype")
    d_gu32, _ = unfused_bwd32(gate_up, d_h)
    assert_bytes_equal(q.data, quantize_ref(d_gu32, fp8.scalar(1.0), E5M2), "d_gate_up beside it")


def test_swiglu_bwd_fp8_amax_only_pass_and_partial_outputs(k):
    t, i = 300, 200
    gate_up, d_h = gate_up_and_d_h(t, i, torch.bfloat16)
    d_gu32, h32 = unfused_bwd32(gate_up, d_h)
    amax = torch.zeros(1, device="cuda")
    scale_inv = fp8.scalar(7.0)
    none = fp8.describe(None, E5M2, shape=(2 * i, t))
    status = k.raw_status("swiglu_bwd_fp8_cuda", fp8.describe(gate_up), fp8.describe(d_h),
                          fp8.describe(None, E5M2, fp8.scalar(math.nan), scale_inv, amax, (t, 2 * i)),
                          none, fp8.describe(None, E4M3, shape=(t, i)), fp8.describe(None, E4M3, shape=(i, t)))
    assert status == 0
    assert amax.item() == d_gu32.abs().max().item() and scale_inv.item() == 7.0
    scale = scale_near(d_gu32, E5M2, 1.0)
    only_t, _ = k.swiglu_bwd_fp8(gate_up, d_h, E5M2, scale, rowwise=False)
    assert only_t.data is None
    assert_bytes_equal(only_t.data_t, quantize_ref(d_gu32, scale, E5M2).t(), "transpose only")
    h_scale = scale_near(h32, E4M3, 1.0)
    _, h_t_only = k.swiglu_bwd_fp8(gate_up, d_h, E5M2, scale, rowwise=False, transpose=False, h=E4M3,
                                   h_scale=h_scale)
    assert_bytes_equal(h_t_only.data_t, quantize_ref(h32, h_scale, E4M3).t(), "h^T alone (one tile)")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_swiglu_bwd_fp8_nan_inf_follow_the_formats(k, dtype):
    gate_up = special_gate_up(dtype)
    d_h = torch.ones(2, 16, device="cuda").to(dtype)
    d_h[1, 3], d_h[1, 4] = math.nan, math.inf
    d_gu32, h32 = unfused_bwd32(gate_up, d_h)
    amax, h_amax = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    q, qh = k.swiglu_bwd_fp8(gate_up, d_h, E5M2, fp8.scalar(2.0), amax=amax, h=E4M3,
                             h_scale=fp8.scalar(2.0), h_rowwise=True, h_amax=h_amax)
    assert_bytes_equal(q.data, quantize_ref(d_gu32, fp8.scalar(2.0), E5M2), "d_gate_up specials")
    assert_bytes_equal(q.data_t, quantize_ref(d_gu32, fp8.scalar(2.0), E5M2).t(), "transposed")
    assert_bytes_equal(qh.data, quantize_ref(h32, fp8.scalar(2.0), E4M3), "h specials")
    assert math.isnan(amax.item()) and math.isnan(h_amax.item())


def test_swiglu_fp8_rejects_bad_arguments(k):
    t, i = 32, 48
    gate_up, d_h = gate_up_and_d_h(t, i, torch.bfloat16)
    h = fp8.empty((t, i), E4M3)
    h_t = fp8.empty((i, t), E4M3)
    scale = fp8.scalar(1.0)
    no_gu = fp8.describe(None, E4M3)
    fwd = lambda *d: k.raw_status("swiglu_fwd_fp8_cuda", *(d if len(d) == 4 else d + (no_gu,)))  # noqa: E731
    ok = fp8.describe(h, scale=scale)
    assert fwd(fp8.describe(gate_up), ok, fp8.describe(h_t)) == 0
    assert fwd(fp8.describe(gate_up[:, :95]), ok, fp8.describe(h_t)) == fp8.STATUS_INVALID_ARGUMENT  # odd 2I
    assert fwd(fp8.describe(fp8.empty((t, 2 * i), E4M3)), ok, fp8.describe(h_t)) == fp8.STATUS_UNSUPPORTED_DTYPE
    assert fwd(fp8.describe(gate_up), fp8.describe(d_h), fp8.describe(h_t)) == fp8.STATUS_UNSUPPORTED_DTYPE
    assert fwd(fp8.describe(gate_up), ok, fp8.describe(h)) == fp8.STATUS_INVALID_ARGUMENT  # not [I, T]
    e5_t = fp8.empty((i, t), E5M2)
    assert fwd(fp8.describe(gate_up), ok, fp8.describe(e5_t)) == fp8.STATUS_INVALID_ARGUMENT  # dtype mismatch
    assert fwd(fp8.describe(gate_up), fp8.describe(h, scale=scale, amax=scale), fp8.describe(h_t)) == \
        fp8.STATUS_INVALID_ARGUMENT  # aliased
    gu_copy = fp8.empty((t, 2 * i), E4M3)
    gu_scale, gu_amax = fp8.scalar(1.0), fp8.scalar(0.0)
    assert fwd(fp8.describe(gate_up), ok, fp8.describe(h_t), fp8.describe(gu_copy, scale=gu_scale)) == 0
    assert fwd(fp8.describe(gate_up), ok, fp8.describe(h_t), fp8.describe(fp8.empty((t, 2 * i), E5M2))) == \
        fp8.STATUS_UNSUPPORTED_DTYPE  # gate_up's copy in another format than h
    assert fwd(fp8.describe(gate_up), ok, fp8.describe(h_t), fp8.describe(gu_copy[:, :2 * i - 16])) == \
        fp8.STATUS_INVALID_ARGUMENT  # not [T, 2I]
    h_amax = fp8.scalar(0.0)
    assert fwd(fp8.describe(gate_up), fp8.describe(h, scale=scale, amax=h_amax), fp8.describe(h_t),
               fp8.describe(gu_copy, scale=gu_scale, amax=h_amax)) == fp8.STATUS_INVALID_ARGUMENT  # one amax
    assert fwd(fp8.describe(gate_up), ok, fp8.describe(h_t), fp8.describe(None, E4M3, amax=gu_amax)) == 0

    bwd = lambda *d: k.raw_status("swiglu_bwd_fp8_cuda", *d)  # noqa: E731
    dgu = fp8.describe(fp8.empty((t, 2 * i), E5M2), scale=scale)
    dgu_t = fp8.describe(fp8.empty((2 * i, t), E5M2))
    h_desc, h_t_desc = fp8.describe(h, scale=scale), fp8.describe(h_t)
    assert bwd(fp8.describe(gate_up), fp8.describe(d_h), dgu, dgu_t, h_desc, h_t_desc) == 0
    assert bwd(fp8.describe(gate_up), fp8.describe(d_h.half()), dgu, dgu_t, h_desc, h_t_desc) == \
        fp8.STATUS_UNSUPPORTED_DTYPE  # d_h dtype
    assert bwd(fp8.describe(gate_up), fp8.describe(d_h[:, :40]), dgu, dgu_t, h_desc, h_t_desc) == \
        fp8.STATUS_INVALID_ARGUMENT  # d_h shape
    assert k.lib.fastffn_last_error().decode().startswith(  # the C layer says which rule broke
        f"fastffn_swiglu_bwd_fp8_cuda: d_h must be [{t}, {i}] with a row stride >= {i}, got [{t}, 40]")
    assert bwd(fp8.describe(gate_up), fp8.describe(d_h), fp8.describe(gate_up), dgu_t, h_desc, h_t_desc) == \
        fp8.STATUS_UNSUPPORTED_DTYPE  # d_gate_up not FP8
    h16 = torch.empty(t, i, device="cuda", dtype=torch.bfloat16)
    assert bwd(fp8.describe(gate_up), fp8.describe(d_h), dgu, dgu_t, fp8.describe(h16), h_t_desc) == \
        fp8.STATUS_INVALID_ARGUMENT  # a 16-bit h has no transposed copy
    assert bwd(fp8.describe(gate_up), fp8.describe(d_h), dgu, dgu_t, fp8.describe(h16, scale=scale),
               fp8.describe(None, E4M3)) == fp8.STATUS_INVALID_ARGUMENT  # nor scaling
    assert bwd(fp8.describe(gate_up), fp8.describe(d_h), dgu, dgu_t, fp8.describe(h16.half()),
               fp8.describe(None, E4M3)) == fp8.STATUS_UNSUPPORTED_DTYPE  # not the input dtype
    shared_amax = fp8.scalar(0.0)
    assert bwd(fp8.describe(gate_up), fp8.describe(d_h),
               fp8.describe(fp8.empty((t, 2 * i), E5M2), scale=scale, amax=shared_amax), dgu_t,
               fp8.describe(h, scale=scale, amax=shared_amax), h_t_desc) == fp8.STATUS_INVALID_ARGUMENT
    # gate_up as the forward's FP8 copy
    gu_scale_inv, q_gu_data = fp8.scalar(1.0), fp8.empty((t, 2 * i), E4M3)
    q_gu = fp8.describe(q_gu_data, scale_inv=gu_scale_inv)
    assert bwd(q_gu, fp8.describe(d_h), dgu, dgu_t, h_desc, h_t_desc) == 0
    assert bwd(q_gu, fp8.describe(d_h.half()), dgu, dgu_t, fp8.describe(h16.half()), fp8.describe(None, E4M3)) == 0
    e5_h = fp8.empty((t, i), E5M2)
    assert bwd(q_gu, fp8.describe(d_h), dgu, dgu_t, fp8.describe(e5_h, scale=scale), fp8.describe(None, E5M2)) == \
        fp8.STATUS_UNSUPPORTED_DTYPE  # an FP8 h in another format than gate_up's
    assert bwd(fp8.describe(gate_up, scale_inv=gu_scale_inv), fp8.describe(d_h), dgu, dgu_t, h_desc, h_t_desc) == \
        fp8.STATUS_INVALID_ARGUMENT  # a 16-bit gate_up has no scale
    d_scale_inv = fp8.scalar(1.0)
    assert bwd(fp8.describe(fp8.empty((t, 2 * i), E4M3), scale_inv=d_scale_inv), fp8.describe(d_h),
               fp8.describe(fp8.empty((t, 2 * i), E5M2), scale=scale, scale_inv=d_scale_inv), dgu_t, h_desc,
               h_t_desc) == fp8.STATUS_INVALID_ARGUMENT  # gate_up's scale_inv is an output's


# --- scale updates ----------------------------------------------------------------------------

FLT_MAX = float(np.finfo(np.float32).max)


def scale_rule(amax: float, previous: float, fmt_max: float, margin: float) -> np.float32:
    """TE's delayed-scaling update in float32 (the C API's rule for both recipes)."""
    scaled_max = np.float32(fmt_max * 2.0**-margin)
    a = np.float32(amax)
    if not (np.isfinite(a) and a > 0):
        return np.float32(previous)
    with np.errstate(over="ignore"):
        s = scaled_max / a
    return np.float32(FLT_MAX) if np.isinf(s) else s


def assert_scale_pair(scale: torch.Tensor, scale_inv: torch.Tensor, expected: np.float32, what: str):
    assert np.float32(scale.item()) == expected, f"{what}: scale {scale.item()!r} != {expected!r}"
    inv = np.float32(1) / expected
    got_inv = np.float32(scale_inv.item())
    # 1 / FLT_MAX is subnormal: --use_fast_math's rcp.rn.ftz flushes it to zero
    assert got_inv == inv or (inv < np.finfo(np.float32).tiny and got_inv == 0), \
        f"{what}: scale_inv {got_inv!r} != {inv!r}"


AMAX_CASES = [1.0, 0.37, 448.0, 1e-3, 7.5e4, 3e38, 2e-38, 1e-40, 0.0, -0.0, -1.0, math.inf, -math.inf,
              math.nan]


@pytest.mark.parametrize("margin", [0.0, 1.0, 2.5])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_compute_scale_is_the_formula(k, fmt, margin):
    fmt_max, previous = fp8.FP8_MAX[fmt], 3.25
    for amax in AMAX_CASES:
        scale, scale_inv = fp8.scalar(previous), fp8.scalar(-1.0)
        k.compute_scale(fp8.scalar(amax), scale, scale_inv, fmt_max, margin)
        assert_scale_pair(scale, scale_inv, scale_rule(amax, previous, fmt_max, margin), f"amax {amax}")


def test_compute_scale_rejects_bad_arguments(k):
    a, s, si = fp8.scalar(1.0), fp8.scalar(1.0), fp8.scalar(1.0)
    raw = lambda *args: k.raw_status("fp8_compute_scale_cuda", *args)  # noqa: E731
    a, s, si = a.data_ptr(), s.data_ptr(), si.data_ptr()
    assert raw(a, s, si, 448.0, 0.0) == 0
    assert raw(None, s, si, 448.0, 0.0) == fp8.STATUS_INVALID_ARGUMENT
    assert raw(a, s, s, 448.0, 0.0) == fp8.STATUS_INVALID_ARGUMENT  # scale_inv = scale
    assert raw(a, a, si, 448.0, 0.0) == fp8.STATUS_INVALID_ARGUMENT  # amax = scale
    assert raw(a, s, si, 448.0, 200.0) == fp8.STATUS_INVALID_ARGUMENT  # 448 * 2^-200 is 0 in fp32
    assert raw(a, s, si, math.nan, 0.0) == fp8.STATUS_INVALID_ARGUMENT


def te_history_update(history: list[float], previous: float, fmt_max: float, margin: float,
                      most_recent: bool):
    """TE's amax_and_scale_update on one history, in numpy float32: (new history, new scale)."""
    h = np.array(history, dtype=np.float32)
    rolled = np.concatenate([h[1:], h[:1]])  # [h1 .. h_{L-1}, h0]
    amax = h[0] if most_recent else np.fmax.reduce(rolled, initial=np.float32(0))  # fmax skips NaN
    new = rolled.copy()
    new[0] = 0
    return new.tolist(), scale_rule(float(amax), previous, fmt_max, margin)


@pytest.mark.parametrize("most_recent", [False, True], ids=["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 2, 5, 256, 300, 1024])
def test_update_amax_history_is_te_amax_and_scale_update(k, length, most_recent):
    torch.manual_seed(length)
    fmt_max, margin, previous = 448.0, 1.0, 2.0
    cases = [torch.rand(length) * 10, torch.zeros(length)]
    with_nan = torch.rand(length) * 10
    with_nan[min(3, length - 1)] = math.nan
    with_inf = torch.rand(length)
    with_inf[0] = math.inf
    cases += [with_nan, with_inf]
    for values in cases:
        history = values.to(torch.float32).cuda()
        scale, scale_inv = fp8.scalar(previous), fp8.scalar(0.0)
        expected_history, expected_scale = te_history_update(values.tolist(), previous, fmt_max, margin,
                                                             most_recent)
        k.update_amax_history(history, scale, scale_inv, fmt_max, margin, most_recent)
        assert_same_floats(history.cpu(), torch.tensor(expected_history), f"history L={length}")
        assert_scale_pair(scale, scale_inv, expected_scale, f"L={length} {values[:4].tolist()}")


def test_update_amax_history_over_steps_keeps_a_window_of_len(k):
    """Five steps of a history of three: each step writes its amax into slot 0 (as the kernels'
    atomics do), then updates; the scale follows the max of the last three amaxes."""
    history = torch.zeros(3, device="cuda")
    scale, scale_inv = fp8.scalar(1.0), fp8.scalar(1.0)
    ref_history, ref_scale = [0.0] * 3, np.float32(1.0)
    for amax in (4.0, 1.0, 2.0, 0.5, 0.25):
        history[0] = amax
        ref_history[0] = amax
        k.update_amax_history(history, scale, scale_inv, 448.0)
        ref_history, ref_scale = te_history_update(ref_history, float(ref_scale), 448.0, 0.0, False)
        assert history.tolist() == ref_history
        assert_scale_pair(scale, scale_inv, ref_scale, f"after amax {amax}")
    assert scale.item() == 448.0 / 2.0, "4 and 1 have left the window of three"


# --- the FP8 FFN ------------------------------------------------------------------------------
# Error budget (norm-wise, against an fp32 FFN of the same bf16 inputs): tests/fp8_ffn_budget.py,
# which the CPU tests of the Paddle FFN share. The bf16 FFN (ops.fused_ffn) has to stay within
# 2^-6 of fp32 for the comparison with it to mean anything.
FP8_BUDGET = FP8_FFN_BUDGET
BF16_BUDGET = 2.0**-6
OUTPUTS = ("y", "d_x", "d_w_gate_up", "d_w_down")
FFN_SHAPES = [(64, 256, 688), (2048, 4096, 11008)]


def ffn_inputs(t, hidden, inter, dtype=torch.bfloat16):
    x = torch.randn(t, hidden, device="cuda").to(dtype)
    w_gu = (torch.randn(2 * inter, hidden, device="cuda") / math.sqrt(hidden)).to(dtype)
    w_d = (torch.randn(hidden, inter, device="cuda") / math.sqrt(inter)).to(dtype)
    dy = torch.randn(t, hidden, device="cuda").to(dtype)
    return x, w_gu, w_d, dy


def ffn_fp32(x, w_gu, w_d, dy):
    """The fp32 FFN of the same values, TF32 off; returns y and the three gradients."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        x32, wgu32, wd32 = (t.float().requires_grad_() for t in (x, w_gu, w_d))
        gate, up = (x32 @ wgu32.t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ wd32.t()
        y.backward(dy.float())
    finally:
        matmul.allow_tf32 = saved
    return dict(zip(OUTPUTS, (y.detach(), x32.grad, wgu32.grad, wd32.grad)))


def run_ffn(fn, x, w_gu, w_d, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gu, w_d)]
    y = fn(*leaves)
    y.backward(dy)
    return dict(zip(OUTPUTS, (y.detach(), *(t.grad for t in leaves))))


def rel_err(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def assert_within_budget(got: dict, ref32: dict, bf16: dict | None, what: str):
    for name in OUTPUTS:
        g = got[name]
        assert torch.isfinite(g).all(), f"{what} {name}: non-finite values"
        err = rel_err(g, ref32[name])
        line = f"{what} {name}: fp8 vs fp32 {err:.4f} (budget {FP8_BUDGET[name]:.3f})"
        if bf16 is not None:
            err_bf16, err_vs_bf16 = rel_err(bf16[name], ref32[name]), rel_err(g, bf16[name])
            line += f", bf16 vs fp32 {err_bf16:.4f}, fp8 vs bf16 {err_vs_bf16:.4f}"
            assert err_bf16 <= BF16_BUDGET, f"{what} {name}: the bf16 FFN is {err_bf16} off fp32"
            assert err_vs_bf16 <= FP8_BUDGET[name] + BF16_BUDGET, line
        print(line)
        assert err <= FP8_BUDGET[name], line


def fp8_fn(state):
    return lambda x, w_gu, w_d: fp8_ffn.fp8_ffn(x, w_gu, w_d, state)


@pytest.mark.parametrize("saved_gate_up", ["fp8", "activation"])
@pytest.mark.parametrize("shape", FFN_SHAPES, ids=str)
def test_fp8_ffn_within_the_fp8_budget_of_fp32_and_bf16(shape, saved_gate_up):
    x, w_gu, w_d, dy = ffn_inputs(*shape)
    ref32 = ffn_fp32(x, w_gu, w_d, dy)
    bf16 = run_ffn(ops.fused_ffn, x, w_gu, w_d, dy)
    recipe = fp8_ffn.Fp8Recipe("current", saved_gate_up=saved_gate_up)
    current = run_ffn(fp8_fn(fp8_ffn.Fp8FFNState(recipe)), x, w_gu, w_d, dy)
    assert_within_budget(current, ref32, bf16, f"current {shape} gate_up saved as {saved_gate_up}")
    # Delayed (most recent amax) on the same inputs: step 1 is its warm start, current scaling of
    # every tensor; steps 2 and 3 take their scales from the history of step 1's (and 2's) amaxes,
    # the same inputs' amaxes. So every step's outputs are the current ones bit for bit (cuBLASLt
    # is deterministic for one algorithm on one GPU): the first step is calibrated.
    state = fp8_ffn.Fp8FFNState(fp8_ffn.Fp8Recipe("delayed", amax_history_len=4, amax_compute_algo="most_recent",
                                                  saved_gate_up=saved_gate_up))
    for step in range(3):
        delayed = run_ffn(fp8_fn(state), x, w_gu, w_d, dy)
        state.cache.invalidate()
        for name in OUTPUTS:
            assert torch.equal(delayed[name], current[name]), f"delayed step {step} != current: {name}"


@pytest.mark.parametrize("weight_copies", ["per_use", "cached"])
@pytest.mark.parametrize("saved_gate_up", ["fp8", "activation"])
@pytest.mark.parametrize("kind", ["current", "delayed"])
def test_fp8_ffn_stages_are_the_gemms_of_their_fp8_operands(kind, saved_gate_up, weight_copies):
    """Every stage checked on its own, from the intermediates the composition records: each
    quantisation bit for bit, each GEMM against the float64 GEMM of its dequantised operands (the
    tolerances of test_fp8_kernels), and the copies each GEMM reads (see fp8_ffn's table; per use,
    the forward records only the weights' forward copies)."""
    t, hidden, inter = 64, 256, 688
    x, w_gu, w_d, dy = ffn_inputs(t, hidden, inter)
    state = fp8_ffn.Fp8FFNState(fp8_ffn.Fp8Recipe(kind, saved_gate_up=saved_gate_up, weight_copies=weight_copies))
    state.record = rec = {}
    out = run_ffn(fp8_fn(state), x, w_gu, w_d, dy)
    current = kind == "current"

    def used_scale(q, ref32, fmt, weight=False):  # what the recipe must have used
        amax = float(ref32.abs().max())
        # Weights are current-scaled under both recipes (Fp8Recipe.ffn_states); delayed
        # scaling's first step is its warm start: current scaling too (TE's would use 1).
        own = current or weight or state.recipe.delayed_warm_start
        expected = scale_rule(amax, 1.0, fp8.FP8_MAX[fmt], 0.0) if own else np.float32(1)
        assert np.float32(q.scale_inv.item()) == np.float32(1) / expected, "scale_inv = 1 / the recipe's scale"
        return fp8.scalar(float(expected))

    def check_quantised(q, value32, fmt, what, transposed=True, weight=False):
        scale = used_scale(q, value32, fmt, weight)
        expected = quantize_ref(value32, scale, fmt)
        if q.data is not None:
            assert_bytes_equal(q.data, expected, f"{what} row-wise")
        if transposed:
            assert_bytes_equal(q.data_t, expected.t(), f"{what} transposed")

    def check_gemm(d, a64, b64, kk, fast, what):
        assert_gemm_close(d, a64 @ b64.t(), a64.abs() @ b64.abs().t(), kk, "fp8_fast" if fast else "fp8", what)

    check_quantised(rec["q_x"], x.float(), E4M3, "q(x)")
    cached = weight_copies == "cached"
    check_quantised(rec["w_gate_up"], w_gu.float(), E4M3, "q(W_gu)", transposed=cached, weight=True)
    check_quantised(rec["w_down"], w_d.float(), E4M3, "q(W_d)", transposed=cached, weight=True)
    x64, wgu64, wd64 = (dequantized64(rec[n]) for n in ("q_x", "w_gate_up", "w_down"))
    check_gemm(rec["gate_up"], x64, wgu64, hidden, True, "gate_up = q(x) q(W_gu)^T")
    h32 = unfused_fwd32(rec["gate_up"])
    check_quantised(rec["q_h"], h32, E4M3, "q(h)", transposed=False)
    assert rec["q_h"].data_t is None, "the forward writes no q(h)^T: the backward recomputes it"
    h64 = dequantized64(rec["q_h"])
    check_gemm(rec["y"], h64, wd64, inter, True, "y = q(h) q(W_d)^T")

    # What the backward reads of gate_up: its FP8 copy (quantised by the forward's own rule), or
    # the 16-bit tensor itself
    saved = rec["saved_gate_up"]
    if saved_gate_up == "fp8":
        gu_scale_inv = rec["saved_gate_up_scale_inv"]
        check_quantised(fp8.Quantized(saved, None, None, gu_scale_inv, None), rec["gate_up"].float(), E4M3,
                        "q(gate_up)", transposed=False)
        backward_gate_up = saved.float() * gu_scale_inv  # the kernels' fp32 reading of the copy
    else:
        assert saved is rec["gate_up"] and rec["saved_gate_up_scale_inv"] is None
        backward_gate_up = rec["gate_up"]

    check_quantised(rec["q_dy"], dy.float(), E5M2, "q(dy)")
    dy64 = dequantized64(rec["q_dy"])
    check_gemm(rec["d_h"], dy64, wd64.t(), hidden, False, "d_h = q(dy) q(W_d^T)^T")
    d_gu32, h_recomputed32 = unfused_bwd32(backward_gate_up, rec["d_h"])
    check_quantised(rec["q_d_gate_up"], d_gu32, E5M2, "q(d_gate_up)")
    # q(h)^T: recomputed and quantised at the forward's scale (from the 16-bit gate_up, the
    # forward's very bytes)
    assert_bytes_equal(rec["q_h_t"].data_t, quantize_ref(h_recomputed32, rec["h_scale"], E4M3).t(),
                      "q(h)^T recomputed")
    if saved_gate_up == "activation":
        assert_bytes_equal(rec["q_h_t"].data_t, rec["q_h"].data.t(), "q(h)^T recomputed = the forward's")
    dgu64 = dequantized64(rec["q_d_gate_up"])
    h_t64 = dequantized64(rec["q_h_t"], transposed=True)
    check_gemm(out["d_w_down"], dy64.t(), h_t64, t, False, "d_W_d = q(dy)^T q(h)^T^T")
    check_gemm(out["d_x"], dgu64, wgu64.t(), 2 * inter, False, "d_x = q(d_gu) q(W_gu^T)^T")
    check_gemm(out["d_w_gate_up"], dgu64.t(), x64.t(), t, False, "d_W_gu = q(d_gu)^T q(x)^T^T")
    for name in ("d_x", "d_w_gate_up", "d_w_down"):
        assert rec[name] is out[name] or torch.equal(rec[name], out[name])


def test_fp8_ffn_rejects_tokens_not_a_multiple_of_16(k):
    t, hidden, inter = 1000, 512, 1376
    x, w_gu, w_d, dy = ffn_inputs(t, hidden, inter)
    state = fp8_ffn.Fp8FFNState()
    with pytest.raises(ValueError, match=r"tokens T = 1000 not a positive multiple of 16.*pad"):
        fp8_ffn.fp8_ffn(x.requires_grad_(), w_gu, w_d, state)
    assert state.cache.quantizations == 0, "rejected before any work"
    # Why: T is the K of the weight-gradient GEMMs, which cuBLASLt's FP8 kernels cannot take.
    q_dy = k.quantize(dy, E5M2, fp8.scalar(1.0))
    q_x = k.quantize(x.detach(), E4M3, fp8.scalar(1.0))
    with pytest.raises(fp8.Fp8Error, match="K % 16") as error:
        k.gemm(q_dy.data_t, q_x.data_t, a_scale_inv=q_dy.scale_inv, b_scale_inv=q_x.scale_inv)
    assert error.value.status == fp8.STATUS_INVALID_ARGUMENT
    # (the SwiGLU kernels themselves take T = 1000: the kernel tests above run it)


def test_fp8_ffn_weight_cache_requantises_a_weight_written_in_place():
    """The core's weight cache (paddle_fastffn/core/fp8/weight_cache.py) keys each copy by torch's
    version counter: an in-place write (an optimizer step is one) re-quantises that weight alone
    at its next use, and the FFN computes with the new values."""
    x, w_gu, w_d, dy = ffn_inputs(64, 256, 688)
    state = fp8_ffn.Fp8FFNState(dataclasses.replace(fp8_ffn.DEFAULT_RECIPE, weight_copies="cached"))
    w_gu.requires_grad_()
    fp8_ffn.fp8_ffn(x, w_gu, w_d, state)
    fp8_ffn.fp8_ffn(x, w_gu, w_d, state)
    assert state.cache.quantizations == 2, "one quantisation per weight per version"
    with torch.no_grad():
        w_gu.mul_(0.5)
    y = fp8_ffn.fp8_ffn(x, w_gu, w_d, state)
    assert state.cache.quantizations == 3, "w_gate_up re-quantised, w_down still cached"
    fresh = fp8_ffn.Fp8FFNState()
    torch.testing.assert_close(y, fp8_ffn.fp8_ffn(x, w_gu, w_d, fresh), rtol=0, atol=0)
    state.cache.invalidate()
    fp8_ffn.fp8_ffn(x, w_gu, w_d, state)
    assert state.cache.quantizations == 5


class TeHistory:
    """The host-side model of one tensor's delayed-scaling state (TE's semantics, with the warm
    start: the first step's scale comes from its own amax)."""

    def __init__(self, length, fmt_max, warm_start=True):
        self.history, self.scale, self.fmt_max = [0.0] * length, np.float32(1.0), fmt_max
        self.warm_start, self.seeded = warm_start, False

    def step(self, amax: float):
        if self.warm_start and not self.seeded:
            self.scale = scale_rule(amax, float(self.scale), self.fmt_max, 0.0)
        self.seeded = True
        used = self.scale
        self.history[0] = max(self.history[0], amax)
        self.history, self.scale = te_history_update(self.history, float(self.scale), self.fmt_max, 0.0, False)
        return used


@pytest.mark.parametrize("weight_copies", ["per_use", "cached"])
@pytest.mark.parametrize("kind", ["current", "delayed"])
def test_fp8_ffn_toy_training_loop(kind, weight_copies):
    """Five SGD steps of one FFN on fresh inputs (loss = sum(y * g), so dy = g): the scales follow
    the recipe step by step (delayed: its warm start, then a history of 3, which wraps), the
    weight cache quantises once per step (cached; per use: each GEMM's copy when it runs, none
    kept), and every step, the first included, stays within the FP8 budget of an fp32 FFN at the
    same weights."""
    t, hidden, inter = 64, 256, 688
    steps, lr, length = 5, 1e-3, 3  # lr: about 5% of the weights' RMS per step at this shape
    _, w_gu, w_d, g = ffn_inputs(t, hidden, inter)
    w_gu.requires_grad_()
    w_d.requires_grad_()
    state = fp8_ffn.Fp8FFNState(fp8_ffn.Fp8Recipe(kind, amax_history_len=length, weight_copies=weight_copies))
    state.record = rec = {}
    x_model, dy_model = TeHistory(length, 448.0), TeHistory(length, 57344.0)
    for step in range(steps):
        x = torch.randn(t, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
        ref32 = ffn_fp32(x.detach(), w_gu.detach(), w_d.detach(), g)
        y = fp8_ffn.fp8_ffn(x, w_gu, w_d, state)
        (y * g).sum().backward()
        got = dict(zip(OUTPUTS, (y.detach(), x.grad, w_gu.grad, w_d.grad)))
        x_amax, dy_amax = float(x.detach().float().abs().max()), float(g.float().abs().max())
        if kind == "current":
            x_used, dy_used = scale_rule(x_amax, 1.0, 448.0, 0.0), scale_rule(dy_amax, 1.0, 57344.0, 0.0)
            assert state.x.amax_history.tolist() == [x_amax] and state.dy.amax_history.tolist() == [dy_amax]
        else:
            x_used, dy_used = x_model.step(x_amax), dy_model.step(dy_amax)
            assert state.x.amax_history.tolist() == x_model.history, f"step {step}: x history"
            assert state.dy.amax_history.tolist() == dy_model.history, f"step {step}: dy history"
            assert np.float32(state.x.scale.item()) == x_model.scale, f"step {step}: next x scale"
            assert np.float32(state.dy.scale.item()) == dy_model.scale, f"step {step}: next dy scale"
        for q, used, what in ((rec["q_x"], x_used, "x"), (rec["q_dy"], dy_used, "dy")):
            assert np.float32(q.scale_inv.item()) == np.float32(1) / used, f"step {step}: {what} scale used"
        assert state.cache.quantizations == (2 * (step + 1) if weight_copies == "cached" else 0)
        assert_within_budget(got, ref32, None, f"{kind} step {step}")  # delayed's first: its warm start
        with torch.no_grad():
            w_gu -= lr * w_gu.grad
            w_d -= lr * w_d.grad
        w_gu.grad = w_d.grad = None
        state.cache.invalidate()
    for s in (state.x, state.w_gate_up, state.w_down, state.h, state.dy, state.d_gate_up):
        assert torch.isfinite(s.scale).all() and (s.scale > 0).all() and torch.isfinite(s.amax_history).all()
