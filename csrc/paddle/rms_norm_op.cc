// Paddle binding of the RMSNorm kernels:
//   fastffn_rms_norm_fwd(x, residual?, weight; epsilon) -> (out, sum, rstd)
//   fastffn_rms_norm_bwd(x, weight, rstd, d_out, d_sum?; epsilon) -> (d_x, d_weight)
// With residual given, `sum` = x + residual (the decoder layer's residual stream) and the norm is
// taken of it; otherwise `sum` is an empty placeholder. rstd is fp32 [rows], kept for backward.
#include "binding_utils.h"

namespace {

using namespace fastffn::paddle_binding;
constexpr const char* kOp = "paddle_fastffn.ops.rms_norm";

fastffn_rms_norm_args make_args(const paddle::Tensor& x, const paddle::Tensor& weight,
                                float epsilon) {
  check_contiguous(x, "x", kOp);
  check_contiguous(weight, "weight", kOp);
  check_same_dtype(x, "x", weight, "weight", kOp);
  check_same_place(x, weight, "weight", kOp);
  PD_CHECK(weight.shape().size() == 1 && !x.shape().empty() &&
               weight.shape()[0] == x.shape().back(),
           kOp, ": argument `weight` must be 1-D with the size of the last axis of `x`");
  fastffn_rms_norm_args args;
  args.rows = rows_of(x);
  args.cols = x.shape().back();
  args.epsilon = epsilon;
  args.dtype = kernel_dtype(x, kOp, "x");
  return args;
}

std::vector<paddle::Tensor> RmsNormForward(const paddle::Tensor& x,
                                           const paddle::optional<paddle::Tensor>& residual,
                                           const paddle::Tensor& weight, float epsilon) {
  const fastffn_rms_norm_args args = make_args(x, weight, epsilon);
  const void* res = nullptr;
  if (residual) {
    check_contiguous(*residual, "residual", kOp);
    check_same_dtype(x, "x", *residual, "residual", kOp);
    check_same_place(x, *residual, "residual", kOp);
    PD_CHECK(residual->shape() == x.shape(), kOp, ": argument `residual` must have the shape of `x`");
    res = residual->data();
  }
  auto out = paddle::empty(x.shape(), x.dtype(), x.place());
  auto sum = residual ? paddle::empty(x.shape(), x.dtype(), x.place())
                      : paddle::empty({0}, x.dtype(), x.place());
  auto rstd = paddle::empty({args.rows}, paddle::DataType::FLOAT32, x.place());
  void* sum_ptr = residual ? sum.data() : nullptr;
  check_status(run_on_device(
                   x, kOp,
                   [&] {
                     return fastffn_rms_norm_fwd_cpu(args, x.data(), res, weight.data(),
                                                     out.data(), sum_ptr, rstd.data<float>());
                   },
                   [&](void* stream) {
                     return fastffn_rms_norm_fwd_cuda(args, x.data(), res, weight.data(),
                                                      out.data(), sum_ptr, rstd.data<float>(),
                                                      stream);
                   }),
               kOp);
  return {out, sum, rstd};
}

std::vector<paddle::Tensor> RmsNormBackward(const paddle::Tensor& x, const paddle::Tensor& weight,
                                            const paddle::Tensor& rstd,
                                            const paddle::Tensor& d_out,
                                            const paddle::optional<paddle::Tensor>& d_sum,
                                            float epsilon) {
  const fastffn_rms_norm_args args = make_args(x, weight, epsilon);
  check_contiguous(d_out, "d_out", kOp);
  check_same_dtype(x, "x", d_out, "d_out", kOp);
  PD_CHECK(d_out.shape() == x.shape(), kOp, ": `d_out` must have the shape of `x`");
  PD_CHECK(rstd.dtype() == paddle::DataType::FLOAT32 && rstd.numel() == args.rows, kOp,
           ": `rstd` must be the float32 [rows] tensor saved by the forward");
  const void* d_sum_ptr = nullptr;
  if (d_sum) {
    check_contiguous(*d_sum, "d_sum", kOp);
    check_same_dtype(x, "x", *d_sum, "d_sum", kOp);
    PD_CHECK(d_sum->shape() == x.shape(), kOp, ": `d_sum` must have the shape of `x`");
    d_sum_ptr = d_sum->data();
  }
  auto d_x = paddle::empty(x.shape(), x.dtype(), x.place());
  auto d_weight = paddle::empty(weight.shape(), weight.dtype(), weight.place());
  check_status(run_on_device(
                   x, kOp,
                   [&] {
                     return fastffn_rms_norm_bwd_cpu(args, x.data(), weight.data(),
                                                     rstd.data<float>(), d_out.data(), d_sum_ptr,
                                                     d_x.data(), d_weight.data());
                   },
                   [&](void* stream) {
                     const int64_t bytes = fastffn_rms_norm_bwd_workspace_bytes_cuda(args);
                     if (bytes < 0) return FASTFFN_STATUS_CUDA_ERROR;
                     auto workspace = paddle::empty({bytes}, paddle::DataType::UINT8, x.place());
                     return fastffn_rms_norm_bwd_cuda(args, x.data(), weight.data(),
                                                      rstd.data<float>(), d_out.data(), d_sum_ptr,
                                                      d_x.data(), d_weight.data(),
                                                      workspace.data(), stream);
                   }),
               kOp);
  return {d_x, d_weight};
}

std::vector<std::vector<int64_t>> RmsNormForwardShape(
    const std::vector<int64_t>& x, const paddle::optional<std::vector<int64_t>>& residual,
    const std::vector<int64_t>&, float) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) rows *= x[i];
  return {x, residual ? x : std::vector<int64_t>{0}, {rows}};
}

std::vector<paddle::DataType> RmsNormForwardDtype(const paddle::DataType& x,
                                                  const paddle::optional<paddle::DataType>&,
                                                  const paddle::DataType&) {
  return {x, x, paddle::DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> RmsNormBackwardShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>& weight,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const paddle::optional<std::vector<int64_t>>&, float) {
  return {x, weight};
}

std::vector<paddle::DataType> RmsNormBackwardDtype(const paddle::DataType& x,
                                                   const paddle::DataType& weight,
                                                   const paddle::DataType&,
                                                   const paddle::DataType&,
                                                   const paddle::optional<paddle::DataType>&) {
  return {x, weight};
}

}  // namespace

PD_BUILD_OP(fastffn_rms_norm_fwd)
    .Inputs({"X", paddle::Optional("Residual"), "Weight"})
    .Outputs({"Out", "Sum", "Rstd"})
    .Attrs({"epsilon: float"})
    .SetKernelFn(PD_KERNEL(RmsNormForward))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormForwardShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormForwardDtype));

PD_BUILD_OP(fastffn_rms_norm_bwd)
    .Inputs({"X", "Weight", "Rstd", "DOut", paddle::Optional("DSum")})
    .Outputs({"DX", "DWeight"})
    .Attrs({"epsilon: float"})
    .SetKernelFn(PD_KERNEL(RmsNormBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormBackwardShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormBackwardDtype));
