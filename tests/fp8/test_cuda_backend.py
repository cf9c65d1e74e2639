"""The CUDA FP8 backend (paddle_fastffn/fp8/cuda.py, csrc/paddle/fp8_op.cc) as far as a CPU machine
can check it: the GEMM table and the token padding (numerically, in numpy), the backend choice
(with given device facts: a pure function), the weight cache keeping CUDA and emulated copies
apart, and the compiled FP8 ops themselves: their argument checks and their refusal of CPU tensors.

The CUDA path is compile-checked here (tests/build_checks/test_cuda_build.py); its kernels are
proven on the H200 through the ctypes harness (paddle_fastffn/torch/fp8/c_api.py, tests/gpu/), but this
Paddle glue has not run on a GPU (no Paddle wheel for sm_90 on PyPI)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_fastffn.fp8 import Fp8Linear, Fp8Recipe, WeightCache
from paddle_fastffn.fp8 import cuda as fp8_cuda
from paddle_fastffn.fp8.cuda import LINEAR_GEMMS, ROWWISE, TRANSPOSED
from paddle_fastffn.ops._loader import run_op

E4M3 = paddle.float8_e4m3fn


def stored_copies(**tensors):
    """{name: {ROWWISE: t, TRANSPOSED: t^T}} of 2-D numpy arrays."""
    return {name: {ROWWISE: t, TRANSPOSED: t.T.copy()} for name, t in tensors.items()}


def run_table_gemm(gemm, copies):
    """D = A @ B^T with A [M, K] and B [N, K] the stored copies LINEAR_GEMMS names (the C API's
    fastffn_gemm_cuda with both operands K-major)."""
    (a_name, a_copy), (b_name, b_copy) = LINEAR_GEMMS[gemm]
    a, b = copies[a_name][a_copy], copies[b_name][b_copy]
    assert a.shape[1] == b.shape[1], f"{gemm}: K of A {a.shape} and of B {b.shape} differ"
    return a @ b.T


@pytest.mark.parametrize("tokens", [16, 37, 1])
def test_gemm_table_gives_the_forward_dgrad_and_wgrad_of_an_in_out_weight(tokens):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, 48))
    w = rng.standard_normal((48, 32))  # Paddle's Linear layout [in, out]
    dy = rng.standard_normal((tokens, 32))
    copies = stored_copies(x=x, weight=w, dy=dy)
    np.testing.assert_allclose(run_table_gemm("forward", copies), x @ w, rtol=1e-12)
    np.testing.assert_allclose(run_table_gemm("dgrad", copies), dy @ w.T, rtol=1e-12)
    np.testing.assert_allclose(run_table_gemm("wgrad", copies), x.T @ dy, rtol=1e-12)


def test_copies_needed_follow_the_gemms_that_run():
    both = frozenset({ROWWISE, TRANSPOSED})
    row, col = frozenset({ROWWISE}), frozenset({TRANSPOSED})
    assert fp8_cuda.copies_needed(True, True) == {"x": both, "weight": both, "dy": both}
    # A frozen weight (LoRA's base): no wgrad, so neither q(x)^T nor q(dy)^T.
    assert fp8_cuda.copies_needed(True, False) == {"x": row, "weight": both, "dy": row}
    # No input gradient (the first layer over a frozen embedding): no dgrad.
    assert fp8_cuda.copies_needed(False, True) == {"x": both, "weight": col, "dy": col}
    assert fp8_cuda.copies_needed(False, False) == {"x": row, "weight": col, "dy": frozenset()}


def test_tokens_pad_to_16_with_zero_columns_that_leave_the_weight_gradient_unchanged():
    assert [fp8_cuda.padded_tokens(t) for t in (0, 1, 15, 16, 17, 32, 1000)] == [0, 16, 16, 16, 32, 32, 1008]
    rng = np.random.default_rng(1)
    tokens, padded = 37, fp8_cuda.padded_tokens(37)
    # Small integers: every product and partial sum is exact in float64, so the comparison is exact
    # whatever order the BLAS sums in (random normals differed in the last bit on one CPU).
    x, dy = rng.integers(-8, 9, (tokens, 32)).astype(np.float64), rng.integers(-8, 9, (tokens, 16)).astype(np.float64)
    x_t, dy_t = np.zeros((32, padded)), np.zeros((16, padded))  # what fastffn_fp8_quantize writes
    x_t[:, :tokens], dy_t[:, :tokens] = x.T, dy.T
    assert x_t.shape[1] % fp8_cuda.GEMM_ALIGNMENT == 0
    np.testing.assert_array_equal(x_t @ dy_t.T, x.T @ dy)


@pytest.mark.parametrize("compiled, capability, ops_error, expected", [
    (False, None, None, "no_cuda"),
    (True, None, None, "arch"),        # a CUDA Paddle with no visible GPU
    (True, (8, 0), None, "arch"),      # A100: no FP8 tensor cores
    (True, (8, 9), None, "arch"),      # Ada has FP8, but the kernels are built for sm_80 / sm_90a
    (True, (10, 0), None, "arch"),     # sm_90a code does not run on Blackwell
    (True, (9, 0), "nvcc not found", "ops"),
    (True, (9, 0), None, None),
])
def test_where_the_cuda_backend_can_run(compiled, capability, ops_error, expected):
    reason = fp8_cuda.unavailable_reason(compiled, capability, ops_error)
    assert (reason and reason[0]) == expected
    if expected == "ops":
        assert "nvcc not found" in reason[1]
    if capability == (8, 9):
        assert "sm_89" in reason[1]


def test_backend_choice():
    choose = fp8_cuda.choose_backend
    assert choose("auto", True, None) == "cuda"
    assert choose("auto", False, None) == "emulated"  # CPU tensors emulate, as before
    assert choose("auto", True, ("arch", "sm_80")) == "emulated"
    assert choose("emulated", True, None) == "emulated"
    assert choose("cuda", True, None) == "cuda"
    with pytest.raises(RuntimeError, match="not a CUDA tensor"):
        choose("cuda", False, None)
    with pytest.raises(RuntimeError, match="sm_86"):
        choose("cuda", True, ("arch", "this device is sm_86"))
    with pytest.raises(ValueError, match="backend"):
        choose("fast", True, None)


def test_fp8_linear_on_cpu_emulates_and_refuses_a_forced_cuda_backend():
    assert fp8_cuda.backend_for("auto", paddle.ones([2, 16])) == "emulated"
    layer = paddle.nn.Linear(16, 16)
    with pytest.raises(RuntimeError, match="backend='cuda'.*not a CUDA tensor"):
        Fp8Linear(layer, Fp8Recipe(), backend="cuda")(paddle.ones([4, 16]))
    with pytest.raises(ValueError, match="backend must be"):
        Fp8Linear(layer, Fp8Recipe(), backend="gpu")


def test_weight_cache_keeps_copies_of_different_quantizers_apart():
    weight = paddle.randn([16, 16])
    state = Fp8Recipe().new_state("e4m3", scaling="current")
    cache = WeightCache()

    def requantize(w, s, amax_recorded=False):  # another quantizer of the same weight, as the CUDA backend's is
        return s.quantize(w, amax_recorded=amax_recorded)

    first = cache.get(weight, state)
    assert cache.get(weight, state) is first and cache.quantizations == 1
    other = cache.get(weight, state, quantize=requantize)
    assert other is not first and cache.quantizations == 2
    assert cache.get(weight, state, quantize=requantize) is other and cache.quantizations == 2


# --- the compiled FP8 ops on CPU tensors ------------------------------------------------------------

def _scalar(value=1.0):
    return paddle.full([1], value, paddle.float32)


def _quantize(x, scale=None, amax=None, fmt="e4m3", rowwise=True, transpose=True, transpose_cols=0):
    return run_op("fastffn_fp8_quantize", x, _scalar() if scale is None else scale,
                  paddle.zeros([1], paddle.float32) if amax is None else amax, fmt, rowwise, transpose,
                  transpose_cols)


def _gemm(a, b, a_scale_inv=None, b_scale_inv=None, out_dtype="bfloat16", transpose_a=False,
          transpose_b=False):
    return run_op("fastffn_gemm", a, b, a_scale_inv, b_scale_inv, out_dtype, transpose_a, transpose_b,
                  False, 1.0)


def _fp8(shape):
    return paddle.randn(shape).astype(E4M3)  # fp32 -> e4m3 casts run on CPU


def _bf16(shape):
    return paddle.randn(shape).astype(paddle.bfloat16)


def _swiglu_fwd(gate_up, scale=None, amax=None, fmt="e4m3", rowwise=True, transpose=False, transpose_cols=0,
                gate_up_scale=None, gate_up_amax=None, gate_up_rowwise=False):
    return run_op("fastffn_swiglu_fwd_fp8", gate_up, _scalar() if scale is None else scale,
                  paddle.zeros([1], paddle.float32) if amax is None else amax, gate_up_scale, gate_up_amax, fmt,
                  rowwise, transpose, transpose_cols, gate_up_rowwise)


def _swiglu_bwd(gate_up, d_h, scale=None, amax=None, h_scale=None, fmt="e5m2", rowwise=True, transpose=True,
                h_fmt="e4m3", h_rowwise=False, h_transpose=True, transpose_cols=0, gate_up_scale_inv=None):
    return run_op("fastffn_swiglu_bwd_fp8", gate_up, d_h, _scalar() if scale is None else scale,
                  paddle.zeros([1], paddle.float32) if amax is None else amax,
                  _scalar() if h_scale is None and h_fmt else h_scale, gate_up_scale_inv, fmt, rowwise, transpose,
                  h_fmt, h_rowwise, h_transpose, transpose_cols)


CUDA_ONLY = r"FP8 needs a CUDA tensor on an sm_90 \(Hopper\) GPU"


@pytest.mark.parametrize("name, call", [
    ("paddle_fastffn.fp8.quantize", lambda: _quantize(paddle.randn([20, 32]))),
    ("paddle_fastffn.fp8.transpose", lambda: run_op("fastffn_fp8_transpose", _fp8([20, 32]))),
    ("paddle_fastffn.fp8.gemm", lambda: _gemm(_fp8([20, 32]), _fp8([16, 32]), _scalar(), _scalar())),
    ("paddle_fastffn.fp8.gemm", lambda: _gemm(paddle.randn([20, 32]).astype(paddle.bfloat16),
                                              paddle.randn([16, 32]).astype(paddle.bfloat16))),
    ("paddle_fastffn.fp8.gemm", lambda: run_op("fastffn_gemm_accumulate", _fp8([20, 32]), _fp8([16, 32]),
                                               _scalar(), _scalar(), paddle.zeros([20, 16]), False, False,
                                               False, 1.0)),
    ("paddle_fastffn.fp8.compute_scale", lambda: run_op("fastffn_fp8_compute_scale", _scalar(2.0),
                                                        _scalar(), _scalar(), 448.0, 0.0)),
    ("paddle_fastffn.fp8.update_amax_history", lambda: run_op(
        "fastffn_fp8_update_amax_history", paddle.zeros([8]), _scalar(), _scalar(), False, 448.0, 0.0)),
    ("paddle_fastffn.fp8.swiglu_fwd", lambda: _swiglu_fwd(paddle.randn([20, 64]), transpose=True,
                                                          transpose_cols=32)),
    ("paddle_fastffn.fp8.swiglu_fwd", lambda: _swiglu_fwd(paddle.randn([20, 64]), rowwise=False)),  # amax pass
    ("paddle_fastffn.fp8.swiglu_fwd", lambda: _swiglu_fwd(paddle.randn([20, 64]), gate_up_scale=_scalar(),
                                                          gate_up_amax=paddle.zeros([4]), gate_up_rowwise=True)),
    ("paddle_fastffn.fp8.swiglu_bwd", lambda: _swiglu_bwd(_fp8([20, 64]), _bf16([20, 32]), transpose_cols=32,
                                                          gate_up_scale_inv=_scalar())),  # from gate_up's copy
    ("paddle_fastffn.fp8.swiglu_bwd", lambda: _swiglu_bwd(paddle.randn([20, 64]), paddle.randn([20, 32]),
                                                          transpose_cols=32)),
    ("paddle_fastffn.fp8.swiglu_bwd", lambda: _swiglu_bwd(_bf16([20, 64]), _bf16([20, 32]), rowwise=False,
                                                          transpose=False, h_fmt="", h_transpose=False)),
])
def test_fp8_ops_refuse_cpu_tensors_naming_the_op(name, call):
    with pytest.raises(Exception, match=f"{name}: got a tensor on .*{CUDA_ONLY}"):
        call()


def test_fp8_ops_leave_cpu_state_untouched_when_they_refuse():
    amax, scale, scale_inv = paddle.zeros([1], paddle.float32), _scalar(3.0), _scalar(5.0)
    with pytest.raises(Exception, match=CUDA_ONLY):
        _quantize(paddle.randn([4, 16]) * 100, amax=amax)
    with pytest.raises(Exception, match=CUDA_ONLY):
        run_op("fastffn_fp8_compute_scale", _scalar(2.0), scale, scale_inv, 448.0, 0.0)
    assert float(amax) == 0.0 and float(scale) == 3.0 and float(scale_inv) == 5.0


@pytest.mark.parametrize("call, message", [
    (lambda: _quantize(paddle.randn([4, 16]), fmt="e3m4"), r"attribute `fmt` must be \"e4m3\" or \"e5m2\""),
    (lambda: _quantize(paddle.randn([2, 4, 16])), r"quantize: argument `x` must be 2-D, got 3"),
    (lambda: _quantize(paddle.randn([4, 16]).astype(paddle.float64)), r"`x` must be bfloat16, float16 or float32"),
    (lambda: _quantize(paddle.randn([4, 16]), scale=paddle.ones([2])), r"`scale` must hold exactly one element"),
    (lambda: _quantize(paddle.randn([4, 16]), amax=paddle.zeros([1], paddle.float64)), r"`amax` must be float32"),
    (lambda: _quantize(paddle.randn([20, 16]), transpose_cols=8), r"`transpose_cols` must be 0 .* rows of `x` \(20\)"),
    (lambda: _quantize(paddle.randn([20, 16]), transpose=False, transpose_cols=32), r"`transpose_cols` needs `transpose`"),
    (lambda: run_op("fastffn_fp8_transpose", paddle.randn([20, 32]).astype(paddle.bfloat16)),
     r"transpose: argument `x` must be float8_e4m3fn or float8_e5m2 \(an FP8 copy\), got bfloat16"),
    (lambda: run_op("fastffn_fp8_transpose", _fp8([2, 4, 16])), r"transpose: argument `x` must be 2-D, got 3"),
    (lambda: _gemm(_fp8([20, 32]), paddle.randn([16, 32]).astype(paddle.bfloat16)), r"must both be FP8 or both 16-bit"),
    (lambda: _gemm(_fp8([32, 20]), _fp8([16, 32]), transpose_a=True), r"FP8 operands must be K-major"),
    (lambda: _gemm(_fp8([20, 32]), _fp8([16, 48])), r"the K of `a` \(32\) and of `b` \(48\) differ"),
    (lambda: _gemm(_fp8([20, 32]), _fp8([16, 32]), out_dtype="float8"), r"attribute `out_dtype` must be"),
    (lambda: _gemm(_fp8([20, 32]), _fp8([16, 32]), a_scale_inv=paddle.ones([1], paddle.float16)),
     r"`a_scale_inv` must be float32"),
    (lambda: _gemm(paddle.randn([20, 32]), paddle.randn([16, 32])), r"must both be bfloat16 or both float16"),
    (lambda: _gemm(paddle.randn([20, 32]).astype(paddle.bfloat16), paddle.randn([16, 32]).astype(paddle.bfloat16),
                   a_scale_inv=_scalar()), r"are for FP8 operands only"),
    (lambda: run_op("fastffn_gemm_accumulate", _fp8([20, 32]), _fp8([16, 32]), _scalar(), _scalar(),
                    paddle.zeros([16, 20]), False, False, False, 1.0), r"argument `d` must be \[20, 16\]"),
    (lambda: run_op("fastffn_fp8_update_amax_history", paddle.zeros([2, 4]), _scalar(), _scalar(), False,
                    448.0, 0.0), r"`amax_history` must be 1-D"),
    (lambda: _swiglu_fwd(paddle.randn([4, 33])),
     r"swiglu_fwd: argument `gate_up` must have an even number of columns"),
    (lambda: _swiglu_fwd(paddle.randn([2, 4, 32])), r"swiglu_fwd: argument `gate_up` must be 2-D, got 3"),
    (lambda: _swiglu_fwd(paddle.randn([4, 32]).astype(paddle.float64)),
     r"`gate_up` must be bfloat16, float16 or float32"),
    (lambda: _swiglu_fwd(paddle.randn([4, 32]), fmt="fp8"), r"swiglu_fwd: attribute `fmt` must be \"e4m3\""),
    (lambda: _swiglu_fwd(paddle.randn([4, 32]), scale=paddle.ones([2])), r"`scale` must hold exactly one element"),
    (lambda: _swiglu_fwd(paddle.randn([20, 32]), transpose=True, transpose_cols=16),
     r"`transpose_cols` must be 0 .* rows of `gate_up` \(20\)"),
    (lambda: _swiglu_bwd(paddle.randn([4, 32]), _bf16([4, 16])),
     r"swiglu_bwd: argument `d_h` must have the dtype of `gate_up`"),
    (lambda: _swiglu_bwd(paddle.randn([4, 32]), paddle.randn([4, 32])), r"argument `d_h` must be \[4, 16\]"),
    (lambda: _swiglu_bwd(paddle.randn([4, 32]), paddle.randn([4, 16]), h_fmt="fp8"), r"attribute `h_fmt` must be"),
    (lambda: _swiglu_bwd(paddle.randn([4, 32]), paddle.randn([4, 16]), h_fmt=""),
     r"`h_rowwise` / `h_transpose` need an FP8 `h_fmt`"),
    (lambda: run_op("fastffn_swiglu_bwd_fp8", paddle.randn([4, 32]), paddle.randn([4, 16]), _scalar(),
                    paddle.zeros([1]), None, None, "e5m2", True, True, "e4m3", False, True, 0),
     r"argument `h_scale` is required"),
    (lambda: _swiglu_fwd(paddle.randn([4, 32]), gate_up_rowwise=True),
     r"argument `gate_up_scale` is required for `gate_up_rowwise`"),
    (lambda: _swiglu_fwd(paddle.randn([4, 32]), gate_up_scale=paddle.ones([2]), gate_up_rowwise=True),
     r"`gate_up_scale` must hold exactly one element"),
    (lambda: _swiglu_fwd(paddle.randn([4, 32]), gate_up_amax=paddle.zeros([1], paddle.float16)),
     r"`gate_up_amax` must be float32"),
    (lambda: _swiglu_bwd(_fp8([4, 32]), _bf16([4, 16])),
     r"swiglu_bwd: argument `gate_up_scale_inv` is required for an FP8 `gate_up`"),
    (lambda: _swiglu_bwd(_fp8([4, 32]), _bf16([4, 16]), gate_up_scale_inv=_scalar(), h_fmt="e5m2"),
     r"attribute `h_fmt` must be the FP8 `gate_up`'s format \"e4m3\""),
    (lambda: _swiglu_bwd(_fp8([4, 32]), _fp8([4, 16]), gate_up_scale_inv=_scalar()),
     r"argument `d_h` must be float32, float16, bfloat16 or float64, got float8_e4m3fn"),
    (lambda: _swiglu_bwd(_bf16([4, 32]), _bf16([4, 16]), gate_up_scale_inv=_scalar()),
     r"`gate_up_scale_inv` is only for an FP8 `gate_up`"),
    (lambda: _swiglu_bwd(paddle.randn([4, 32]), paddle.randn([4, 16]), h_scale=paddle.ones([1], paddle.float16)),
     r"`h_scale` must be float32"),
    (lambda: _swiglu_bwd(paddle.randn([4, 32]), paddle.randn([4, 16]), amax=paddle.zeros([0])),
     r"`amax` must hold at least one"),
])
def test_fp8_op_argument_errors_name_the_argument(call, message):
    with pytest.raises(Exception, match=message):
        call()


def test_fp8_scale_ops_reject_one_tensor_as_scale_and_scale_inv():
    scale = _scalar()
    with pytest.raises(Exception, match="`scale` and `scale_inv` must be distinct"):
        run_op("fastffn_fp8_compute_scale", _scalar(2.0), scale, scale, 448.0, 0.0)
