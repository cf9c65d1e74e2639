// Paddle binding of the FP8 entry points of fastffn/scaled_tensor.h (GPU only):
//   fastffn_fp8_quantize(x, scale, amax; fmt, rowwise, transpose, transpose_cols)
//       -> q [R, C], q_t [C, transpose_cols], scale_inv [1]; amax max-accumulated in place
//   fastffn_fp8_transpose(x) -> x^T [C, R]: an FP8 copy's other layout, byte for byte (the
//       quantize entry point given FP8 x: no scaling, no amax)
//   fastffn_gemm(a, b, a_scale_inv?, b_scale_inv?; out_dtype, transpose_a, transpose_b,
//                fast_accum, alpha) -> d [M, N]
//   fastffn_gemm_accumulate(a, b, a_scale_inv?, b_scale_inv?, d; ...) -> d += a @ b^T in place
//   fastffn_fp8_compute_scale(amax, scale, scale_inv; fmt_max, margin): scale, scale_inv in place
//   fastffn_fp8_update_amax_history(history, scale, scale_inv; most_recent, fmt_max, margin):
//       all three in place
// The semantics (which copy a GEMM reads, saturation, the scale rules) are the header's; the
// Python backend (paddle_fastffn/fp8/cuda.py) composes these calls. Every argument check runs
// before the device check, so a CPU build reports the same argument errors (tests/fp8 checks
// them there) and then refuses CPU tensors: FP8 needs a CUDA tensor on sm_90.
#include "fp8_binding.h"

namespace {

using namespace fastffn::paddle_binding;
constexpr const char* kQuantize = "paddle_fastffn.fp8.quantize";
constexpr const char* kTranspose = "paddle_fastffn.fp8.transpose";
constexpr const char* kGemm = "paddle_fastffn.fp8.gemm";
constexpr const char* kScale = "paddle_fastffn.fp8.compute_scale";
constexpr const char* kHistory = "paddle_fastffn.fp8.update_amax_history";

// --- argument translation ----------------------------------------------------------------------

paddle::DataType out_dtype_of(const std::string& name) {
  if (name == "bfloat16") return paddle::DataType::BFLOAT16;
  if (name == "float16") return paddle::DataType::FLOAT16;
  if (name == "float32") return paddle::DataType::FLOAT32;
  PD_THROW(kGemm, ": attribute `out_dtype` must be \"bfloat16\", \"float16\" or \"float32\", got \"",
           name, "\"");
}

// The C API dtype of a GEMM operand or output (16-bit, fp32 or FP8).
fastffn_dtype any_kernel_dtype(const paddle::Tensor& t, const char* op, const char* arg) {
  switch (t.dtype()) {
    case paddle::DataType::FLOAT8_E4M3FN: return FASTFFN_DTYPE_FP8_E4M3;
    case paddle::DataType::FLOAT8_E5M2: return FASTFFN_DTYPE_FP8_E5M2;
    case paddle::DataType::FLOAT32: return FASTFFN_DTYPE_FLOAT32;
    case paddle::DataType::FLOAT16: return FASTFFN_DTYPE_FLOAT16;
    case paddle::DataType::BFLOAT16: return FASTFFN_DTYPE_BFLOAT16;
    default:
      PD_THROW(op, ": argument `", arg, "` must be float8_e4m3fn, float8_e5m2, bfloat16, float16 ",
               "or float32, got ", phi::DataTypeToString(t.dtype()));
  }
}

// --- quantize ----------------------------------------------------------------------------------

std::vector<paddle::Tensor> Fp8Quantize(const paddle::Tensor& x, const paddle::Tensor& scale,
                                        paddle::Tensor& amax, const std::string& fmt, bool rowwise,
                                        bool transpose, int64_t transpose_cols) {
  fp8_dtype_of(fmt, kQuantize);
  check_matrix(x, "x", kQuantize);
  const fastffn_dtype x_dtype = quantizable_dtype(x, "x", kQuantize);
  check_fp32(scale, "scale", kQuantize, true);
  check_fp32(amax, "amax", kQuantize, false);
  check_same_place(x, scale, "scale", kQuantize);
  check_same_place(x, amax, "amax", kQuantize);
  const int64_t rows = x.shape()[0], cols = x.shape()[1];
  check_transpose_cols(transpose_cols, rows, transpose, "x", kQuantize);
  require_cuda(x, kQuantize);

  Fp8Output out = fp8_output(x.place(), fmt, kQuantize, rows, cols, rowwise, transpose,
                             transpose_cols, fp32_ptr(scale), amax.data<float>());
  fastffn_status status = FASTFFN_STATUS_OK;
#if defined(PADDLE_WITH_CUDA)
  auto stream = static_cast<cudaStream_t>(x.stream());
  status = out.prepare(stream);
  if (status == FASTFFN_STATUS_OK)
    status = fastffn_fp8_quantize_cuda(describe(x, x_dtype), out.desc, out.desc_t, stream);
#else
  (void)x_dtype;
#endif
  check_status(status, kQuantize);
  return {out.data, out.data_t, out.scale_inv};
}

std::vector<std::vector<int64_t>> Fp8QuantizeShape(const std::vector<int64_t>& x,
                                                   const std::vector<int64_t>&,
                                                   const std::vector<int64_t>&, const std::string&,
                                                   bool rowwise, bool transpose,
                                                   int64_t transpose_cols) {
  if (x.size() != 2) return {{0}, {0}, {0}};
  return {rowwise ? x : std::vector<int64_t>{0}, transposed_shape(x[0], x[1], transpose, transpose_cols),
          {rowwise || transpose ? 1 : 0}};
}

std::vector<paddle::DataType> Fp8QuantizeDtype(const paddle::DataType&, const paddle::DataType&,
                                               const paddle::DataType&, const std::string& fmt,
                                               bool, bool, int64_t) {
  const paddle::DataType fp8 = fp8_dtype_of(fmt, kQuantize);
  return {fp8, fp8, paddle::DataType::FLOAT32};
}

// --- byte transpose ----------------------------------------------------------------------------

std::vector<paddle::Tensor> Fp8Transpose(const paddle::Tensor& x) {
  check_matrix(x, "x", kTranspose);
  PD_CHECK(is_fp8(x), kTranspose, ": argument `x` must be float8_e4m3fn or float8_e5m2 (an FP8 copy), got ",
           phi::DataTypeToString(x.dtype()));
  require_cuda(x, kTranspose);
  const int64_t rows = x.shape()[0], cols = x.shape()[1];
  auto out_t = paddle::empty({cols, rows}, x.dtype(), x.place());
  fastffn_status status = FASTFFN_STATUS_OK;
#if defined(PADDLE_WITH_CUDA)
  const fastffn_dtype dtype = any_kernel_dtype(x, kTranspose, "x");
  status = fastffn_fp8_quantize_cuda(describe(x, dtype), absent(dtype, rows, cols), describe(out_t, dtype),
                                     static_cast<void*>(x.stream()));
#endif
  check_status(status, kTranspose);
  return {out_t};
}

std::vector<std::vector<int64_t>> Fp8TransposeShape(const std::vector<int64_t>& x) {
  if (x.size() != 2) return {{0}};
  return {{x[1], x[0]}};
}

std::vector<paddle::DataType> Fp8TransposeDtype(const paddle::DataType& x) { return {x}; }

// --- GEMM --------------------------------------------------------------------------------------

struct GemmCall {
  fastffn_tensor a, b;
  fastffn_gemm_config config;
  int64_t m, n;
};

// Checks a GEMM's operands and describes them; D[M, N] = A @ B^T with A = a or a^T, B = b or b^T.
GemmCall make_gemm(const paddle::Tensor& a, const paddle::Tensor& b,
                   const paddle::optional<paddle::Tensor>& a_scale_inv,
                   const paddle::optional<paddle::Tensor>& b_scale_inv, bool transpose_a,
                   bool transpose_b, bool accumulate, bool fast_accum, float alpha) {
  check_matrix(a, "a", kGemm);
  check_matrix(b, "b", kGemm);
  check_same_place(a, b, "b", kGemm);
  GemmCall call;
  call.a = describe(a, any_kernel_dtype(a, kGemm, "a"));
  call.b = describe(b, any_kernel_dtype(b, kGemm, "b"));
  const bool fp8 = is_fp8(a);
  PD_CHECK(fp8 == is_fp8(b), kGemm, ": arguments `a` (", phi::DataTypeToString(a.dtype()), ") and `b` (",
           phi::DataTypeToString(b.dtype()), ") must both be FP8 or both 16-bit");
  if (!fp8)
    PD_CHECK(a.dtype() == b.dtype() && a.dtype() != paddle::DataType::FLOAT32, kGemm,
             ": 16-bit GEMM operands `a` and `b` must both be bfloat16 or both float16, got ",
             phi::DataTypeToString(a.dtype()), " and ", phi::DataTypeToString(b.dtype()));
  PD_CHECK(fp8 || (!a_scale_inv && !b_scale_inv), kGemm,
           ": `a_scale_inv` / `b_scale_inv` are for FP8 operands only (16-bit operands have nothing "
           "to scale)");
  PD_CHECK(!fp8 || (!transpose_a && !transpose_b), kGemm,
           ": FP8 operands must be K-major (cuBLASLt's only FP8 layout on Hopper): pass the "
           "transposed copies that quantize writes instead of `transpose_a` / `transpose_b`");
  if (a_scale_inv) {
    check_fp32(*a_scale_inv, "a_scale_inv", kGemm, true);
    check_same_place(a, *a_scale_inv, "a_scale_inv", kGemm);
    call.a.scale_inv = fp32_ptr(*a_scale_inv);
  }
  if (b_scale_inv) {
    check_fp32(*b_scale_inv, "b_scale_inv", kGemm, true);
    check_same_place(a, *b_scale_inv, "b_scale_inv", kGemm);
    call.b.scale_inv = fp32_ptr(*b_scale_inv);
  }
  const int64_t k_a = transpose_a ? a.shape()[0] : a.shape()[1];
  const int64_t k_b = transpose_b ? b.shape()[0] : b.shape()[1];
  PD_CHECK(k_a == k_b, kGemm, ": the K of `a` (", k_a, ") and of `b` (", k_b,
           ") differ; D = A @ B^T with A [M, K] and B [N, K]");
  call.m = transpose_a ? a.shape()[1] : a.shape()[0];
  call.n = transpose_b ? b.shape()[1] : b.shape()[0];
  call.config = {transpose_a ? 1 : 0, transpose_b ? 1 : 0, accumulate ? 1 : 0, fast_accum ? 1 : 0,
                 alpha};
  return call;
}

fastffn_status run_gemm(const GemmCall& call, const paddle::Tensor& d) {
#if defined(PADDLE_WITH_CUDA)
  return fastffn_gemm_cuda(call.a, call.b, describe(d, any_kernel_dtype(d, kGemm, "d")), call.config,
                           static_cast<void*>(d.stream()));
#else
  (void)call;
  (void)d;
  return FASTFFN_STATUS_INVALID_ARGUMENT;  // unreachable: require_cuda ran
#endif
}

std::vector<paddle::Tensor> Gemm(const paddle::Tensor& a, const paddle::Tensor& b,
                                 const paddle::optional<paddle::Tensor>& a_scale_inv,
                                 const paddle::optional<paddle::Tensor>& b_scale_inv,
                                 const std::string& out_dtype, bool transpose_a, bool transpose_b,
                                 bool fast_accum, float alpha) {
  const paddle::DataType dtype = out_dtype_of(out_dtype);
  GemmCall call = make_gemm(a, b, a_scale_inv, b_scale_inv, transpose_a, transpose_b, false,
                            fast_accum, alpha);
  require_cuda(a, kGemm);
  auto d = paddle::empty({call.m, call.n}, dtype, a.place());
  check_status(run_gemm(call, d), kGemm);
  return {d};
}

void GemmAccumulate(const paddle::Tensor& a, const paddle::Tensor& b,
                    const paddle::optional<paddle::Tensor>& a_scale_inv,
                    const paddle::optional<paddle::Tensor>& b_scale_inv, paddle::Tensor& d,
                    bool transpose_a, bool transpose_b, bool fast_accum, float alpha) {
  GemmCall call = make_gemm(a, b, a_scale_inv, b_scale_inv, transpose_a, transpose_b, true,
                            fast_accum, alpha);
  check_matrix(d, "d", kGemm);
  check_same_place(a, d, "d", kGemm);
  PD_CHECK(d.shape()[0] == call.m && d.shape()[1] == call.n, kGemm, ": argument `d` must be [",
           call.m, ", ", call.n, "] (D = A @ B^T), got [", d.shape()[0], ", ", d.shape()[1], "]");
  PD_CHECK(d.dtype() != paddle::DataType::FLOAT8_E4M3FN && d.dtype() != paddle::DataType::FLOAT8_E5M2,
           kGemm, ": argument `d` must be bfloat16, float16 or float32 (FP8 outputs are reserved)");
  require_cuda(a, kGemm);
  check_status(run_gemm(call, d), kGemm);
}

std::vector<std::vector<int64_t>> GemmShape(const std::vector<int64_t>& a,
                                            const std::vector<int64_t>& b,
                                            const paddle::optional<std::vector<int64_t>>&,
                                            const paddle::optional<std::vector<int64_t>>&,
                                            const std::string&, bool transpose_a, bool transpose_b,
                                            bool, float) {
  if (a.size() != 2 || b.size() != 2) return {{0, 0}};
  return {{transpose_a ? a[1] : a[0], transpose_b ? b[1] : b[0]}};
}

std::vector<paddle::DataType> GemmDtype(const paddle::DataType&, const paddle::DataType&,
                                        const paddle::optional<paddle::DataType>&,
                                        const paddle::optional<paddle::DataType>&,
                                        const std::string& out_dtype, bool, bool, bool, float) {
  return {out_dtype_of(out_dtype)};
}

// --- scale updates -----------------------------------------------------------------------------

void check_scale_pair(const paddle::Tensor& ref, const paddle::Tensor& scale,
                      const paddle::Tensor& scale_inv, const char* op) {
  check_fp32(scale, "scale", op, true);
  check_fp32(scale_inv, "scale_inv", op, true);
  check_same_place(ref, scale, "scale", op);
  check_same_place(ref, scale_inv, "scale_inv", op);
  PD_CHECK(scale.data() != scale_inv.data(), op, ": `scale` and `scale_inv` must be distinct tensors");
}

void ComputeScale(const paddle::Tensor& amax, paddle::Tensor& scale, paddle::Tensor& scale_inv,
                  float fmt_max, float margin) {
  check_fp32(amax, "amax", kScale, false);
  check_scale_pair(amax, scale, scale_inv, kScale);
  require_cuda(amax, kScale);
#if defined(PADDLE_WITH_CUDA)
  check_status(fastffn_fp8_compute_scale_cuda(amax.data<float>(), scale.data<float>(),
                                              scale_inv.data<float>(), fmt_max, margin,
                                              static_cast<void*>(amax.stream())),
               kScale);
#else
  (void)fmt_max;
  (void)margin;
#endif
}

void UpdateAmaxHistory(paddle::Tensor& history, paddle::Tensor& scale, paddle::Tensor& scale_inv,
                       bool most_recent, float fmt_max, float margin) {
  check_fp32(history, "amax_history", kHistory, false);
  PD_CHECK(history.shape().size() == 1, kHistory, ": argument `amax_history` must be 1-D, got ",
           history.shape().size(), " dimensions");
  check_scale_pair(history, scale, scale_inv, kHistory);
  require_cuda(history, kHistory);
#if defined(PADDLE_WITH_CUDA)
  check_status(fastffn_fp8_update_amax_history_cuda(history.data<float>(), history.numel(),
                                                    most_recent ? 1 : 0, scale.data<float>(),
                                                    scale_inv.data<float>(), fmt_max, margin,
                                                    static_cast<void*>(history.stream())),
               kHistory);
#else
  (void)most_recent;
  (void)fmt_max;
  (void)margin;
#endif
}

}  // namespace

PD_BUILD_OP(fastffn_fp8_quantize)
    .Inputs({"X", "Scale", "Amax"})
    .Outputs({"Out", "OutT", "ScaleInv", "AmaxOut"})
    .Attrs({"fmt: std::string", "rowwise: bool", "transpose: bool", "transpose_cols: int64_t"})
    .SetInplaceMap({{"Amax", "AmaxOut"}})
    .SetKernelFn(PD_KERNEL(Fp8Quantize))
    .SetInferShapeFn(PD_INFER_SHAPE(Fp8QuantizeShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Fp8QuantizeDtype));

PD_BUILD_OP(fastffn_fp8_transpose)
    .Inputs({"X"})
    .Outputs({"OutT"})
    .SetKernelFn(PD_KERNEL(Fp8Transpose))
    .SetInferShapeFn(PD_INFER_SHAPE(Fp8TransposeShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Fp8TransposeDtype));

PD_BUILD_OP(fastffn_gemm)
    .Inputs({"A", "B", paddle::Optional("AScaleInv"), paddle::Optional("BScaleInv")})
    .Outputs({"D"})
    .Attrs({"out_dtype: std::string", "transpose_a: bool", "transpose_b: bool", "fast_accum: bool",
            "alpha: float"})
    .SetKernelFn(PD_KERNEL(Gemm))
    .SetInferShapeFn(PD_INFER_SHAPE(GemmShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GemmDtype));

PD_BUILD_OP(fastffn_gemm_accumulate)
    .Inputs({"A", "B", paddle::Optional("AScaleInv"), paddle::Optional("BScaleInv"), "D"})
    .Outputs({"DOut"})
    .Attrs({"transpose_a: bool", "transpose_b: bool", "fast_accum: bool", "alpha: float"})
    .SetInplaceMap({{"D", "DOut"}})
    .SetKernelFn(PD_KERNEL(GemmAccumulate));

PD_BUILD_OP(fastffn_fp8_compute_scale)
    .Inputs({"Amax", "Scale", "ScaleInv"})
    .Outputs({"ScaleOut", "ScaleInvOut"})
    .Attrs({"fmt_max: float", "margin: float"})
    .SetInplaceMap({{"Scale", "ScaleOut"}, {"ScaleInv", "ScaleInvOut"}})
    .SetKernelFn(PD_KERNEL(ComputeScale));

PD_BUILD_OP(fastffn_fp8_update_amax_history)
    .Inputs({"AmaxHistory", "Scale", "ScaleInv"})
    .Outputs({"AmaxHistoryOut", "ScaleOut", "ScaleInvOut"})
    .Attrs({"most_recent: bool", "fmt_max: float", "margin: float"})
    .SetInplaceMap({{"AmaxHistory", "AmaxHistoryOut"}, {"Scale", "ScaleOut"},
                    {"ScaleInv", "ScaleInvOut"}})
    .SetKernelFn(PD_KERNEL(UpdateAmaxHistory));
