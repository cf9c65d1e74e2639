// Paddle binding of SwiGLU fused with FP8 quantisation (fastffn/scaled_tensor.h, swiglu_fp8.cu;
// GPU only), the activation of the FP8 FFN (paddle_fastffn/fp8/ffn.py):
//   fastffn_swiglu_fwd_fp8(gate_up, scale, amax; fmt, rowwise, transpose, transpose_cols)
//       -> q(h) [T, I], q(h)^T [I, transpose_cols], scale_inv [1]; amax max-accumulated in place.
//       rowwise = transpose = false is the amax-only pass of current scaling (scale_inv [0]).
//   fastffn_swiglu_bwd_fp8(gate_up, d_h, scale, amax, h_scale?; fmt, rowwise, transpose, h_fmt,
//                          h_rowwise, h_transpose, transpose_cols)
//       -> q(d_gate_up) [T, 2I], q(d_gate_up)^T [2I, transpose_cols], scale_inv [1],
//          q(h) [T, I], q(h)^T [I, transpose_cols], h_scale_inv [1]; amax in place.
//       h (recomputed, quantised with h_scale) only with h_fmt "e4m3" / "e5m2"; h_fmt "" writes
//       none. rowwise = transpose = false with no h is d_gate_up's amax-only pass.
// gate_up [T, 2I] is [gate | up] per row (bf16, fp16 or fp32), d_h [T, I] in its dtype. Absent
// outputs are [0]. Transposed copies of transpose_cols > T columns have zeros past T (the padded
// K of the weight-gradient GEMMs). The semantics are the header's; argument checks run before the
// device check, so a CPU build reports them (tests/fp8) and then refuses CPU tensors.
#include "fp8_binding.h"

namespace {

using namespace fastffn::paddle_binding;
constexpr const char* kFwd = "paddle_fastffn.fp8.swiglu_fwd";
constexpr const char* kBwd = "paddle_fastffn.fp8.swiglu_bwd";

// gate_up [T, 2I]: 2-D, contiguous, 16-bit or fp32, an even column count ([gate | up]).
fastffn_dtype check_gate_up(const paddle::Tensor& gate_up, const char* op) {
  check_matrix(gate_up, "gate_up", op);
  const fastffn_dtype dtype = quantizable_dtype(gate_up, "gate_up", op);
  PD_CHECK(gate_up.shape()[1] % 2 == 0, op, ": argument `gate_up` must have an even number of ",
           "columns ([gate | up] per row), got ", gate_up.shape()[1]);
  return dtype;
}

void check_scaling(const paddle::Tensor& ref, const paddle::Tensor& scale, const paddle::Tensor& amax,
                   const char* op) {
  check_fp32(scale, "scale", op, true);
  check_fp32(amax, "amax", op, false);
  check_same_place(ref, scale, "scale", op);
  check_same_place(ref, amax, "amax", op);
}

// --- forward -----------------------------------------------------------------------------------

std::vector<paddle::Tensor> SwigluFwdFp8(const paddle::Tensor& gate_up, const paddle::Tensor& scale,
                                         paddle::Tensor& amax, const std::string& fmt, bool rowwise,
                                         bool transpose, int64_t transpose_cols) {
  fp8_dtype_of(fmt, kFwd);
  const fastffn_dtype in_dtype = check_gate_up(gate_up, kFwd);
  check_scaling(gate_up, scale, amax, kFwd);
  const int64_t rows = gate_up.shape()[0], cols = gate_up.shape()[1] / 2;
  check_transpose_cols(transpose_cols, rows, transpose, "gate_up", kFwd);
  require_cuda(gate_up, kFwd);

  Fp8Output h = fp8_output(gate_up.place(), fmt, kFwd, rows, cols, rowwise, transpose, transpose_cols,
                           fp32_ptr(scale), amax.data<float>());
  fastffn_status status = FASTFFN_STATUS_OK;
#if defined(PADDLE_WITH_CUDA)
  auto stream = static_cast<cudaStream_t>(gate_up.stream());
  status = h.prepare(stream);
  if (status == FASTFFN_STATUS_OK)
    status = fastffn_swiglu_fwd_fp8_cuda(describe(gate_up, in_dtype), h.desc, h.desc_t, stream);
#else
  (void)in_dtype;
#endif
  check_status(status, kFwd);
  return {h.data, h.data_t, h.scale_inv};
}

std::vector<std::vector<int64_t>> SwigluFwdFp8Shape(const std::vector<int64_t>& gate_up,
                                                    const std::vector<int64_t>&,
                                                    const std::vector<int64_t>&, const std::string&,
                                                    bool rowwise, bool transpose,
                                                    int64_t transpose_cols) {
  if (gate_up.size() != 2) return {{0}, {0}, {0}};
  const int64_t rows = gate_up[0], cols = gate_up[1] / 2;
  return {rowwise ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{0},
          transposed_shape(rows, cols, transpose, transpose_cols), {rowwise || transpose ? 1 : 0}};
}

std::vector<paddle::DataType> SwigluFwdFp8Dtype(const paddle::DataType&, const paddle::DataType&,
                                                const paddle::DataType&, const std::string& fmt, bool,
                                                bool, int64_t) {
  const paddle::DataType fp8 = fp8_dtype_of(fmt, kFwd);
  return {fp8, fp8, paddle::DataType::FLOAT32};
}

// --- backward ----------------------------------------------------------------------------------

// h_fmt "" (no h) or an FP8 format; the FP8 dtype of the h outputs (e4m3 when there is no h).
paddle::DataType h_dtype_of(const std::string& h_fmt) {
  return h_fmt.empty() ? paddle::DataType::FLOAT8_E4M3FN : fp8_dtype_of(h_fmt, kBwd, "h_fmt");
}

std::vector<paddle::Tensor> SwigluBwdFp8(const paddle::Tensor& gate_up, const paddle::Tensor& d_h,
                                         const paddle::Tensor& scale, paddle::Tensor& amax,
                                         const paddle::optional<paddle::Tensor>& h_scale,
                                         const std::string& fmt, bool rowwise, bool transpose,
                                         const std::string& h_fmt, bool h_rowwise, bool h_transpose,
                                         int64_t transpose_cols) {
  fp8_dtype_of(fmt, kBwd);
  h_dtype_of(h_fmt);
  const fastffn_dtype in_dtype = check_gate_up(gate_up, kBwd);
  const int64_t rows = gate_up.shape()[0], cols = gate_up.shape()[1] / 2;
  check_matrix(d_h, "d_h", kBwd);
  check_same_dtype(gate_up, "gate_up", d_h, "d_h", kBwd);
  PD_CHECK(d_h.shape()[0] == rows && d_h.shape()[1] == cols, kBwd, ": argument `d_h` must be [", rows,
           ", ", cols, "] (gate_up is [T, 2I]), got [", d_h.shape()[0], ", ", d_h.shape()[1], "]");
  check_same_place(gate_up, d_h, "d_h", kBwd);
  check_scaling(gate_up, scale, amax, kBwd);
  const bool h_out = h_rowwise || h_transpose;
  PD_CHECK(!h_out || !h_fmt.empty(), kBwd,
           ": `h_rowwise` / `h_transpose` need an FP8 `h_fmt` (\"e4m3\" or \"e5m2\")");
  PD_CHECK(!h_out || h_scale, kBwd, ": argument `h_scale` is required for a quantised h (the "
           "forward's scale of h)");
  if (h_scale) {
    check_fp32(*h_scale, "h_scale", kBwd, true);
    check_same_place(gate_up, *h_scale, "h_scale", kBwd);
  }
  check_transpose_cols(transpose_cols, rows, transpose || h_transpose, "gate_up", kBwd);
  require_cuda(gate_up, kBwd);

  Fp8Output d = fp8_output(gate_up.place(), fmt, kBwd, rows, 2 * cols, rowwise, transpose,
                           transpose_cols, fp32_ptr(scale), amax.data<float>());
  // h: quantised with the forward's scale, no amax (the forward recorded it); absent without h_fmt.
  Fp8Output h = fp8_output(gate_up.place(), h_fmt.empty() ? "e4m3" : h_fmt, kBwd, rows, cols, h_rowwise,
                           h_transpose, transpose_cols, h_out ? fp32_ptr(*h_scale) : nullptr, nullptr);
  fastffn_status status = FASTFFN_STATUS_OK;
#if defined(PADDLE_WITH_CUDA)
  auto stream = static_cast<cudaStream_t>(gate_up.stream());
  status = d.prepare(stream);
  if (status == FASTFFN_STATUS_OK) status = h.prepare(stream);
  if (status == FASTFFN_STATUS_OK)
    status = fastffn_swiglu_bwd_fp8_cuda(describe(gate_up, in_dtype), describe(d_h, in_dtype), d.desc,
                                         d.desc_t, h.desc, h.desc_t, stream);
#else
  (void)in_dtype;
#endif
  check_status(status, kBwd);
  return {d.data, d.data_t, d.scale_inv, h.data, h.data_t, h.scale_inv};
}

std::vector<std::vector<int64_t>> SwigluBwdFp8Shape(
    const std::vector<int64_t>& gate_up, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const paddle::optional<std::vector<int64_t>>&, const std::string&,
    bool rowwise, bool transpose, const std::string&, bool h_rowwise, bool h_transpose,
    int64_t transpose_cols) {
  if (gate_up.size() != 2) return {{0}, {0}, {0}, {0}, {0}, {0}};
  const int64_t rows = gate_up[0], cols = gate_up[1] / 2;
  const auto shape_if = [](bool wanted, std::vector<int64_t> shape) {
    return wanted ? shape : std::vector<int64_t>{0};
  };
  return {shape_if(rowwise, {rows, 2 * cols}),
          transposed_shape(rows, 2 * cols, transpose, transpose_cols),
          {rowwise || transpose ? 1 : 0},
          shape_if(h_rowwise, {rows, cols}),
          transposed_shape(rows, cols, h_transpose, transpose_cols),
          {h_rowwise || h_transpose ? 1 : 0}};
}

std::vector<paddle::DataType> SwigluBwdFp8Dtype(
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::optional<paddle::DataType>&, const std::string& fmt, bool, bool,
    const std::string& h_fmt, bool, bool, int64_t) {
  const paddle::DataType fp8 = fp8_dtype_of(fmt, kBwd), h_fp8 = h_dtype_of(h_fmt);
  return {fp8, fp8, paddle::DataType::FLOAT32, h_fp8, h_fp8, paddle::DataType::FLOAT32};
}

}  // namespace

PD_BUILD_OP(fastffn_swiglu_fwd_fp8)
    .Inputs({"GateUp", "Scale", "Amax"})
    .Outputs({"H", "HT", "ScaleInv", "AmaxOut"})
    .Attrs({"fmt: std::string", "rowwise: bool", "transpose: bool", "transpose_cols: int64_t"})
    .SetInplaceMap({{"Amax", "AmaxOut"}})
    .SetKernelFn(PD_KERNEL(SwigluFwdFp8))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluFwdFp8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluFwdFp8Dtype));

PD_BUILD_OP(fastffn_swiglu_bwd_fp8)
    .Inputs({"GateUp", "DH", "Scale", "Amax", paddle::Optional("HScale")})
    .Outputs({"DGateUp", "DGateUpT", "ScaleInv", "H", "HT", "HScaleInv", "AmaxOut"})
    .Attrs({"fmt: std::string", "rowwise: bool", "transpose: bool", "h_fmt: std::string",
            "h_rowwise: bool", "h_transpose: bool", "transpose_cols: int64_t"})
    .SetInplaceMap({{"Amax", "AmaxOut"}})
    .SetKernelFn(PD_KERNEL(SwigluBwdFp8))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluBwdFp8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluBwdFp8Dtype));
