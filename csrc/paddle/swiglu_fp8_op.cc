// Paddle binding of SwiGLU fused with FP8 quantisation (fastffn/scaled_tensor.h, swiglu_fp8.cu;
// GPU only), the activation of the FP8 FFN (paddle_fastffn/fp8/ffn.py):
//   fastffn_swiglu_fwd_fp8(gate_up, scale, amax, gate_up_scale?, gate_up_amax?; fmt, rowwise,
//                          transpose, transpose_cols, gate_up_rowwise)
//       -> q(h) [T, I], q(h)^T [I, transpose_cols], scale_inv [1], q(gate_up) [T, 2I],
//          gate_up_scale_inv [1]; amax (and gate_up_amax) max-accumulated in place.
//       rowwise = transpose = false is the amax-only pass of current scaling (scale_inv [0]);
//       gate_up_amax given: that pass (and any other) also accumulates gate_up's own amax.
//       gate_up_rowwise (needs gate_up_scale): the FP8 copy of gate_up in fmt, for the backward.
//   fastffn_swiglu_bwd_fp8(gate_up, d_h, scale, amax, h_scale?, gate_up_scale_inv?; fmt, rowwise,
//                          transpose, h_fmt, h_rowwise, h_transpose, transpose_cols)
//       -> q(d_gate_up) [T, 2I], q(d_gate_up)^T [2I, transpose_cols], scale_inv [1],
//          q(h) [T, I], q(h)^T [I, transpose_cols], h_scale_inv [1]; amax in place.
//       h (recomputed, quantised with h_scale) only with h_fmt "e4m3" / "e5m2"; h_fmt "" writes
//       none. rowwise = transpose = false with no h is d_gate_up's amax-only pass.
// gate_up [T, 2I] is [gate | up] per row: bf16, fp16 or fp32 (d_h [T, I] in its dtype), or in the
// backward the forward's FP8 copy with its gate_up_scale_inv (d_h then bf16, fp16 or fp32). Absent
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
                                         paddle::Tensor& amax,
                                         const paddle::optional<paddle::Tensor>& gate_up_scale,
                                         paddle::optional<paddle::Tensor>& gate_up_amax,
                                         const std::string& fmt, bool rowwise, bool transpose,
                                         int64_t transpose_cols, bool gate_up_rowwise) {
  fp8_dtype_of(fmt, kFwd);
  const fastffn_dtype in_dtype = check_gate_up(gate_up, kFwd);
  check_scaling(gate_up, scale, amax, kFwd);
  const int64_t rows = gate_up.shape()[0], cols = gate_up.shape()[1] / 2;
  check_transpose_cols(transpose_cols, rows, transpose, "gate_up", kFwd);
  PD_CHECK(!gate_up_rowwise || gate_up_scale, kFwd,
           ": argument `gate_up_scale` is required for `gate_up_rowwise` (the FP8 copy of gate_up)");
  if (gate_up_scale) {
    check_fp32(*gate_up_scale, "gate_up_scale", kFwd, true);
    check_same_place(gate_up, *gate_up_scale, "gate_up_scale", kFwd);
  }
  if (gate_up_amax) {
    check_fp32(*gate_up_amax, "gate_up_amax", kFwd, false);
    check_same_place(gate_up, *gate_up_amax, "gate_up_amax", kFwd);
  }
  require_cuda(gate_up, kFwd);

  Fp8Output h = fp8_output(gate_up.place(), fmt, kFwd, rows, cols, rowwise, transpose, transpose_cols,
                           fp32_ptr(scale), amax.data<float>());
  // gate_up's own copy in the forward format: row-wise only, no transpose.
  Fp8Output gu = fp8_output(gate_up.place(), fmt, kFwd, rows, 2 * cols, gate_up_rowwise, false, 0,
                            gate_up_rowwise ? fp32_ptr(*gate_up_scale) : nullptr,
                            gate_up_amax ? gate_up_amax->data<float>() : nullptr);
  fastffn_status status = FASTFFN_STATUS_OK;
#if defined(PADDLE_WITH_CUDA)
  auto stream = static_cast<cudaStream_t>(gate_up.stream());
  status = h.prepare(stream);
  if (status == FASTFFN_STATUS_OK)
    status = fastffn_swiglu_fwd_fp8_cuda(describe(gate_up, in_dtype), h.desc, h.desc_t, gu.desc, stream);
#else
  (void)in_dtype;
#endif
  check_status(status, kFwd);
  return {h.data, h.data_t, h.scale_inv, gu.data, gu.scale_inv};
}

std::vector<std::vector<int64_t>> SwigluFwdFp8Shape(const std::vector<int64_t>& gate_up,
                                                    const std::vector<int64_t>&,
                                                    const std::vector<int64_t>&,
                                                    const paddle::optional<std::vector<int64_t>>&,
                                                    const paddle::optional<std::vector<int64_t>>&,
                                                    const std::string&, bool rowwise, bool transpose,
                                                    int64_t transpose_cols, bool gate_up_rowwise) {
  if (gate_up.size() != 2) return {{0}, {0}, {0}, {0}, {0}};
  const int64_t rows = gate_up[0], cols = gate_up[1] / 2;
  return {rowwise ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{0},
          transposed_shape(rows, cols, transpose, transpose_cols), {rowwise || transpose ? 1 : 0},
          gate_up_rowwise ? std::vector<int64_t>{rows, 2 * cols} : std::vector<int64_t>{0},
          {gate_up_rowwise ? 1 : 0}};
}

std::vector<paddle::DataType> SwigluFwdFp8Dtype(const paddle::DataType&, const paddle::DataType&,
                                                const paddle::DataType&,
                                                const paddle::optional<paddle::DataType>&,
                                                const paddle::optional<paddle::DataType>&,
                                                const std::string& fmt, bool, bool, int64_t, bool) {
  const paddle::DataType fp8 = fp8_dtype_of(fmt, kFwd);
  return {fp8, fp8, paddle::DataType::FLOAT32, fp8, paddle::DataType::FLOAT32};
}

// --- backward ----------------------------------------------------------------------------------

// h_fmt "" (no h) or an FP8 format; the FP8 dtype of the h outputs (e4m3 when there is no h).
paddle::DataType h_dtype_of(const std::string& h_fmt) {
  return h_fmt.empty() ? paddle::DataType::FLOAT8_E4M3FN : fp8_dtype_of(h_fmt, kBwd, "h_fmt");
}

// The backward's gate_up: 16/32-bit in d_h's dtype, or the forward's FP8 copy with its
// gate_up_scale_inv (then an FP8 h must be of its format). Returns gate_up's kernel descriptor.
fastffn_tensor backward_gate_up(const paddle::Tensor& gate_up, const paddle::Tensor& d_h,
                                const paddle::optional<paddle::Tensor>& gate_up_scale_inv,
                                const std::string& h_fmt) {
  if (!is_fp8(gate_up)) {
    const fastffn_dtype in_dtype = check_gate_up(gate_up, kBwd);
    check_same_dtype(gate_up, "gate_up", d_h, "d_h", kBwd);
    PD_CHECK(!gate_up_scale_inv, kBwd, ": argument `gate_up_scale_inv` is only for an FP8 `gate_up`");
    return describe(gate_up, in_dtype);
  }
  check_matrix(gate_up, "gate_up", kBwd);
  PD_CHECK(gate_up.shape()[1] % 2 == 0, kBwd, ": argument `gate_up` must have an even number of ",
           "columns ([gate | up] per row), got ", gate_up.shape()[1]);
  PD_CHECK(gate_up_scale_inv, kBwd, ": argument `gate_up_scale_inv` is required for an FP8 `gate_up`");
  check_fp32(*gate_up_scale_inv, "gate_up_scale_inv", kBwd, true);
  check_same_place(gate_up, *gate_up_scale_inv, "gate_up_scale_inv", kBwd);
  const std::string gate_up_fmt = gate_up.dtype() == paddle::DataType::FLOAT8_E4M3FN ? "e4m3" : "e5m2";
  PD_CHECK(h_fmt.empty() || h_fmt == gate_up_fmt, kBwd, ": attribute `h_fmt` must be the FP8 `gate_up`'s format \"",
           gate_up_fmt, "\" (both are the forward format), got \"", h_fmt, "\"");
  fastffn_tensor desc = describe(gate_up, fp8_kernel_dtype(gate_up_fmt));
  desc.scale_inv = fp32_ptr(*gate_up_scale_inv);
  return desc;
}

std::vector<paddle::Tensor> SwigluBwdFp8(const paddle::Tensor& gate_up, const paddle::Tensor& d_h,
                                         const paddle::Tensor& scale, paddle::Tensor& amax,
                                         const paddle::optional<paddle::Tensor>& h_scale,
                                         const paddle::optional<paddle::Tensor>& gate_up_scale_inv,
                                         const std::string& fmt, bool rowwise, bool transpose,
                                         const std::string& h_fmt, bool h_rowwise, bool h_transpose,
                                         int64_t transpose_cols) {
  fp8_dtype_of(fmt, kBwd);
  h_dtype_of(h_fmt);
  check_matrix(d_h, "d_h", kBwd);
  const fastffn_tensor gate_up_desc = backward_gate_up(gate_up, d_h, gate_up_scale_inv, h_fmt);
  const int64_t rows = gate_up.shape()[0], cols = gate_up.shape()[1] / 2;
  const fastffn_dtype d_h_dtype = quantizable_dtype(d_h, "d_h", kBwd);
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
    status = fastffn_swiglu_bwd_fp8_cuda(gate_up_desc, describe(d_h, d_h_dtype), d.desc, d.desc_t, h.desc,
                                         h.desc_t, stream);
#else
  (void)gate_up_desc;
  (void)d_h_dtype;
#endif
  check_status(status, kBwd);
  return {d.data, d.data_t, d.scale_inv, h.data, h.data_t, h.scale_inv};
}

std::vector<std::vector<int64_t>> SwigluBwdFp8Shape(
    const std::vector<int64_t>& gate_up, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const paddle::optional<std::vector<int64_t>>&,
    const paddle::optional<std::vector<int64_t>>&, const std::string&,
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
    const paddle::optional<paddle::DataType>&, const paddle::optional<paddle::DataType>&,
    const std::string& fmt, bool, bool,
    const std::string& h_fmt, bool, bool, int64_t) {
  const paddle::DataType fp8 = fp8_dtype_of(fmt, kBwd), h_fp8 = h_dtype_of(h_fmt);
  return {fp8, fp8, paddle::DataType::FLOAT32, h_fp8, h_fp8, paddle::DataType::FLOAT32};
}

}  // namespace

PD_BUILD_OP(fastffn_swiglu_fwd_fp8)
    .Inputs({"GateUp", "Scale", "Amax", paddle::Optional("GateUpScale"), paddle::Optional("GateUpAmax")})
    .Outputs({"H", "HT", "ScaleInv", "GateUpQ", "GateUpScaleInv", "AmaxOut", paddle::Optional("GateUpAmaxOut")})
    .Attrs({"fmt: std::string", "rowwise: bool", "transpose: bool", "transpose_cols: int64_t",
            "gate_up_rowwise: bool"})
    .SetInplaceMap({{"Amax", "AmaxOut"}, {paddle::Optional("GateUpAmax"), paddle::Optional("GateUpAmaxOut")}})
    .SetKernelFn(PD_KERNEL(SwigluFwdFp8))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluFwdFp8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluFwdFp8Dtype));

PD_BUILD_OP(fastffn_swiglu_bwd_fp8)
    .Inputs({"GateUp", "DH", "Scale", "Amax", paddle::Optional("HScale"), paddle::Optional("GateUpScaleInv")})
    .Outputs({"DGateUp", "DGateUpT", "ScaleInv", "H", "HT", "HScaleInv", "AmaxOut"})
    .Attrs({"fmt: std::string", "rowwise: bool", "transpose: bool", "h_fmt: std::string",
            "h_rowwise: bool", "h_transpose: bool", "transpose_cols: int64_t"})
    .SetInplaceMap({{"Amax", "AmaxOut"}})
    .SetKernelFn(PD_KERNEL(SwigluBwdFp8))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluBwdFp8Shape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluBwdFp8Dtype));
