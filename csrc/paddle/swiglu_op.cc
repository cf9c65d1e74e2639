// Paddle binding of the SwiGLU kernels: fastffn_swiglu_fwd(x, y?) and fastffn_swiglu_bwd(x, y?,
// d_out, with_recompute). With y absent, x packs [gate | up] on its last axis (PaddleNLP's
// gate_up_fused_proj layout) and the gradient comes back packed the same way.
#include "binding_utils.h"

namespace {

using namespace fastffn::paddle_binding;
constexpr const char* kOp = "paddle_fastffn.ops.swiglu";

struct SwigluView {
  fastffn_swiglu_args args;
  std::vector<int64_t> out_shape;
};

SwigluView make_view(const paddle::Tensor& x, const paddle::optional<paddle::Tensor>& y) {
  check_contiguous(x, "x", kOp);
  PD_CHECK(x.shape().size() >= 1, kOp, ": argument `x` must have at least one dimension");
  SwigluView v;
  v.out_shape = x.shape();
  const int64_t last = v.out_shape.back();
  v.args.dtype = kernel_dtype(x, kOp, "x");
  v.args.rows = rows_of(x);
  v.args.gate = x.data();
  if (y) {
    check_contiguous(*y, "y", kOp);
    check_same_dtype(x, "x", *y, "y", kOp);
    check_same_place(x, *y, "y", kOp);
    PD_CHECK(y->shape() == x.shape(), kOp, ": argument `y` must have the shape of `x`");
    v.args.cols = last;
    v.args.up = y->data();
    v.args.gate_row_stride = v.args.up_row_stride = last;
  } else {
    PD_CHECK(last % 2 == 0, kOp, ": argument `x` packs [gate | up] on its last axis, so that axis ",
             "must be even when `y` is None; got ", last);
    v.args.cols = last / 2;
    v.args.up = static_cast<const char*>(x.data()) + v.args.cols * phi::SizeOf(x.dtype());
    v.args.gate_row_stride = v.args.up_row_stride = last;
    v.out_shape.back() = last / 2;
  }
  return v;
}

std::vector<paddle::Tensor> SwigluForward(const paddle::Tensor& x,
                                          const paddle::optional<paddle::Tensor>& y) {
  SwigluView v = make_view(x, y);
  auto out = paddle::empty(v.out_shape, x.dtype(), x.place());
  const int64_t cols = v.args.cols;
  check_status(run_on_device(
                   x, kOp, [&] { return fastffn_swiglu_fwd_cpu(v.args, out.data(), cols); },
                   [&](void* stream) {
                     return fastffn_swiglu_fwd_cuda(v.args, out.data(), cols, stream);
                   }),
               kOp);
  return {out};
}

// Returns d_x (and d_y when y was given, else an empty placeholder) and, when with_recompute is
// set, the recomputed forward output for the down projection's weight gradient.
std::vector<paddle::Tensor> SwigluBackward(const paddle::Tensor& x,
                                           const paddle::optional<paddle::Tensor>& y,
                                           const paddle::Tensor& d_out, bool with_recompute) {
  SwigluView v = make_view(x, y);
  check_contiguous(d_out, "d_out", kOp);
  check_same_dtype(x, "x", d_out, "d_out", kOp);
  PD_CHECK(d_out.shape() == v.out_shape, kOp, ": `d_out` must have the output's shape");
  const int64_t cols = v.args.cols;
  auto d_x = paddle::empty(x.shape(), x.dtype(), x.place());
  paddle::Tensor d_y = y ? paddle::empty(x.shape(), x.dtype(), x.place())
                         : paddle::empty({0}, x.dtype(), x.place());
  paddle::Tensor recomputed = with_recompute ? paddle::empty(v.out_shape, x.dtype(), x.place())
                                             : paddle::empty({0}, x.dtype(), x.place());
  void* d_gate = d_x.data();
  void* d_up = y ? d_y.data()
                 : static_cast<void*>(static_cast<char*>(d_x.data()) + cols * phi::SizeOf(x.dtype()));
  const int64_t d_stride = v.args.gate_row_stride;
  void* h = with_recompute ? recomputed.data() : nullptr;
  check_status(run_on_device(
                   x, kOp,
                   [&] {
                     return fastffn_swiglu_bwd_cpu(v.args, d_out.data(), cols, d_gate, d_stride,
                                                   d_up, d_stride, h, cols);
                   },
                   [&](void* stream) {
                     return fastffn_swiglu_bwd_cuda(v.args, d_out.data(), cols, d_gate, d_stride,
                                                    d_up, d_stride, h, cols, stream);
                   }),
               kOp);
  return {d_x, d_y, recomputed};
}

// The FFN's recompute backward, in place: x (packed [gate | up]) becomes d_x and d_out becomes the
// recomputed SwiGLU output, so the backward needs no buffer beyond its inputs (the C API allows
// this aliasing: each element is read before it is written).
void SwigluBackwardInPlace(paddle::Tensor& x, paddle::Tensor& d_out) {
  SwigluView v = make_view(x, paddle::none);
  check_contiguous(d_out, "d_out", kOp);
  check_same_dtype(x, "x", d_out, "d_out", kOp);
  PD_CHECK(d_out.shape() == v.out_shape, kOp, ": `d_out` must have the output's shape");
  const int64_t cols = v.args.cols;
  void* d_gate = x.data();
  void* d_up = static_cast<char*>(x.data()) + cols * phi::SizeOf(x.dtype());
  const int64_t stride = v.args.gate_row_stride;
  check_status(run_on_device(
                   x, kOp,
                   [&] {
                     return fastffn_swiglu_bwd_cpu(v.args, d_out.data(), cols, d_gate, stride,
                                                   d_up, stride, d_out.data(), cols);
                   },
                   [&](void* stream) {
                     return fastffn_swiglu_bwd_cuda(v.args, d_out.data(), cols, d_gate, stride,
                                                    d_up, stride, d_out.data(), cols, stream);
                   }),
               kOp);
}

// The two-input backward, in place: x becomes d_x and y becomes d_y (the unfused MLP's gate_proj
// and up_proj outputs, which nothing else reads), so it allocates no [tokens, 2I]. No recompute:
// the caller keeps the SwiGLU output where it needs it.
void SwigluPairBackwardInPlace(paddle::Tensor& x, paddle::Tensor& y, const paddle::Tensor& d_out) {
  SwigluView v = make_view(x, y);
  check_contiguous(d_out, "d_out", kOp);
  check_same_dtype(x, "x", d_out, "d_out", kOp);
  PD_CHECK(d_out.shape() == v.out_shape, kOp, ": `d_out` must have the output's shape");
  const int64_t cols = v.args.cols;
  const int64_t stride = v.args.gate_row_stride;
  check_status(run_on_device(
                   x, kOp,
                   [&] {
                     return fastffn_swiglu_bwd_cpu(v.args, d_out.data(), cols, x.data(), stride, y.data(),
                                                   stride, nullptr, cols);
                   },
                   [&](void* stream) {
                     return fastffn_swiglu_bwd_cuda(v.args, d_out.data(), cols, x.data(), stride,
                                                    y.data(), stride, nullptr, cols, stream);
                   }),
               kOp);
}

std::vector<std::vector<int64_t>> SwigluForwardShape(
    const std::vector<int64_t>& x, const paddle::optional<std::vector<int64_t>>& y) {
  std::vector<int64_t> out = x;
  if (!y && !out.empty()) out.back() /= 2;
  return {out};
}

std::vector<paddle::DataType> SwigluForwardDtype(const paddle::DataType& x,
                                                 const paddle::optional<paddle::DataType>&) {
  return {x};
}

std::vector<std::vector<int64_t>> SwigluBackwardShape(
    const std::vector<int64_t>& x, const paddle::optional<std::vector<int64_t>>& y,
    const std::vector<int64_t>& d_out, bool with_recompute) {
  return {x, y ? x : std::vector<int64_t>{0}, with_recompute ? d_out : std::vector<int64_t>{0}};
}

std::vector<paddle::DataType> SwigluBackwardDtype(const paddle::DataType& x,
                                                  const paddle::optional<paddle::DataType>&,
                                                  const paddle::DataType&) {
  return {x, x, x};
}

}  // namespace

PD_BUILD_OP(fastffn_swiglu_fwd)
    .Inputs({"X", paddle::Optional("Y")})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(SwigluForward))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluForwardShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluForwardDtype));

PD_BUILD_OP(fastffn_swiglu_bwd)
    .Inputs({"X", paddle::Optional("Y"), "DOut"})
    .Outputs({"DX", "DY", "Recomputed"})
    .Attrs({"with_recompute: bool"})
    .SetKernelFn(PD_KERNEL(SwigluBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluBackwardShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluBackwardDtype));

PD_BUILD_OP(fastffn_swiglu_bwd_inplace)
    .Inputs({"X", "DOut"})
    .Outputs({"DX", "Recomputed"})
    .SetInplaceMap({{"X", "DX"}, {"DOut", "Recomputed"}})
    .SetKernelFn(PD_KERNEL(SwigluBackwardInPlace));

PD_BUILD_OP(fastffn_swiglu_pair_bwd_inplace)
    .Inputs({"X", "Y", "DOut"})
    .Outputs({"DX", "DY"})
    .SetInplaceMap({{"X", "DX"}, {"Y", "DY"}})
    .SetKernelFn(PD_KERNEL(SwigluPairBackwardInPlace));
