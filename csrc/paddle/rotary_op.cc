// Paddle binding of the rotary-embedding kernel:
//   fastffn_rotary(q, k, cos, sin, position_ids?; inverse) -> (q_out, k_out)
// q [batch, seq, q_heads, head_dim], k [batch, seq, k_heads, head_dim]; cos/sin fp32
// [table_rows, head_dim]; position_ids int64 [batch, seq]. inverse=true is the backward.
// q and k may be strided views whose token stride exceeds heads * head_dim (slices of a fused QKV
// projection): only the head and head_dim axes must be dense.
#include "binding_utils.h"

namespace {

using namespace fastffn::paddle_binding;
constexpr const char* kOp = "paddle_fastffn.ops.rotary_embedding";

int64_t token_stride(const paddle::Tensor& t, const char* arg) {
  const auto shape = t.shape();
  if (t.is_contiguous()) return shape[2] * shape[3];
  const auto strides = t.strides();
  PD_CHECK(strides[3] == 1 && strides[2] == shape[3] && strides[0] == strides[1] * shape[1], kOp,
           ": argument `", arg, "` must be dense within each token (the Python wrapper makes it so)");
  return strides[1];
}

std::vector<paddle::Tensor> Rotary(const paddle::Tensor& q, const paddle::Tensor& k,
                                   const paddle::Tensor& cos, const paddle::Tensor& sin,
                                   const paddle::optional<paddle::Tensor>& position_ids,
                                   bool inverse) {
  PD_CHECK(q.shape().size() == 4, kOp, ": argument `q` must be [batch, seq, heads, head_dim]");
  PD_CHECK(k.shape().size() == 4, kOp, ": argument `k` must be [batch, seq, heads, head_dim]");
  check_same_dtype(q, "q", k, "k", kOp);
  check_same_place(q, k, "k", kOp);
  const auto qs = q.shape();
  const auto ks = k.shape();
  PD_CHECK(ks[0] == qs[0] && ks[1] == qs[1] && ks[3] == qs[3], kOp,
           ": `k` must share batch, seq and head_dim with `q`");
  for (const paddle::Tensor* t : {&cos, &sin}) {
    PD_CHECK(t->dtype() == paddle::DataType::FLOAT32 && t->shape().size() == 2 &&
                 t->shape()[1] == qs[3] && t->is_contiguous(),
             kOp, ": cos/sin must be contiguous float32 [table_rows, head_dim]");
    check_same_place(q, *t, "cos/sin", kOp);
  }
  fastffn_rotary_args args;
  args.batch = qs[0];
  args.seq = qs[1];
  args.q_heads = qs[2];
  args.k_heads = ks[2];
  args.head_dim = qs[3];
  args.q_token_stride = token_stride(q, "q");
  args.k_token_stride = token_stride(k, "k");
  args.q_out_token_stride = 0;  // dense outputs
  args.k_out_token_stride = 0;
  args.table_rows = cos.shape()[0];
  args.inverse = inverse ? 1 : 0;
  args.dtype = kernel_dtype(q, kOp, "q");
  args.position_error = nullptr;
  const int64_t* pos = nullptr;
  if (position_ids) {
    PD_CHECK(position_ids->dtype() == paddle::DataType::INT64 && position_ids->is_contiguous() &&
                 position_ids->numel() == qs[0] * qs[1],
             kOp, ": `position_ids` must be contiguous int64 [batch, seq]");
    check_same_place(q, *position_ids, "position_ids", kOp);
    pos = position_ids->data<int64_t>();
  }  // heads, head_dim and seq against the table: the C layer's rules (check_rotary)
  auto q_out = paddle::empty(qs, q.dtype(), q.place());
  auto k_out = paddle::empty(ks, k.dtype(), k.place());
  const fastffn_status status = run_on_device(
      q, kOp,
      [&] {
        return fastffn_rotary_cpu(args, q.data(), k.data(), cos.data<float>(), sin.data<float>(),
                                  pos, q_out.data(), k_out.data());
      },
      [&](void* stream) {
        // The ids live on the device: the kernel flags an out-of-range one, and one 4-byte copy
        // reads the flag (forward only: the backward reuses ids the forward checked).
        paddle::Tensor error;
        if (pos != nullptr && !inverse) {
          error = paddle::full({1}, 0, paddle::DataType::INT32, q.place());
          args.position_error = error.data<int32_t>();
        }
        fastffn_status cuda_status =
            fastffn_rotary_cuda(args, q.data(), k.data(), cos.data<float>(), sin.data<float>(),
                                pos, q_out.data(), k_out.data(), stream);
        if (cuda_status == FASTFFN_STATUS_OK && args.position_error != nullptr &&
            error.copy_to(paddle::CPUPlace(), true).data<int32_t>()[0] != 0)
          cuda_status = FASTFFN_STATUS_INVALID_ARGUMENT;
        return cuda_status;
      });
  // On the GPU the ids are on the device: the kernel's flag says only that one was out of range.
  PD_CHECK(status != FASTFFN_STATUS_INVALID_ARGUMENT || pos == nullptr || q.is_cpu(), kOp,
           ": `position_ids` holds a position outside the cos/sin table [0, ", args.table_rows, ")");
  check_status(status, kOp);
  return {q_out, k_out};
}

std::vector<std::vector<int64_t>> RotaryShape(const std::vector<int64_t>& q,
                                              const std::vector<int64_t>& k,
                                              const std::vector<int64_t>&,
                                              const std::vector<int64_t>&,
                                              const paddle::optional<std::vector<int64_t>>&,
                                              bool) {
  return {q, k};
}

std::vector<paddle::DataType> RotaryDtype(const paddle::DataType& q, const paddle::DataType& k,
                                          const paddle::DataType&, const paddle::DataType&,
                                          const paddle::optional<paddle::DataType>&) {
  return {q, k};
}

}  // namespace

PD_BUILD_OP(fastffn_rotary)
    .Inputs({"Q", "K", "Cos", "Sin", paddle::Optional("PositionIds")})
    .Outputs({"QOut", "KOut"})
    .Attrs({"inverse: bool"})
    .SetKernelFn(PD_KERNEL(Rotary))
    .SetInferShapeFn(PD_INFER_SHAPE(RotaryShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RotaryDtype));
