// Paddle binding of the rotary-embedding kernel (fastffn_rotary_* in c_api.h):
//   fastffn_rotary(q, k?, v?, cos, sin, position_ids?, out, k_out?, v_out?, position_error?;
//                  dims, layouts, with_v, inverse)
// Every q/k/v source and output is addressed by a heads layout with an element offset into its
// tensor, so q, k and v can be read out of one fused qkv tensor (k and v absent: they live in
// q's tensor) and d_q, d_k, d_v written into one d_qkv buffer (k_out and v_out absent: they live
// in out's tensor). The outputs and the position flag are written in place (no allocation here:
// the caller, paddle_fastffn/core/rotary.py, decides what exists).
//   dims    = {batch, seq, q_heads, k_heads, head_dim}
//   layouts = 6 x {offset, token_stride, group_stride, heads_per_group, head_stride} for
//             q, k, v, q_out, k_out, v_out (v's entries ignored without with_v)
// cos/sin: contiguous fp32 [table_rows, head_dim]; position_ids: contiguous int64 [batch, seq];
// position_error: one zeroed int32 where the tensors are; the kernel sets it for a position
// outside the table (the caller reads it once per step, see core/rotary.py).
#include "binding_utils.h"

namespace {

using namespace fastffn::paddle_binding;
constexpr const char* kOp = "paddle_fastffn.ops.rotary_embedding";
constexpr int kLayoutFields = 5;
const char* const kSlotNames[6] = {"q", "k", "v", "q_out", "k_out", "v_out"};

struct HeadsView {
  int64_t offset;
  fastffn_heads_layout layout;
};

HeadsView view_at(const std::vector<int64_t>& layouts, int slot) {
  const int64_t* f = layouts.data() + slot * kLayoutFields;
  return {f[0], fastffn_heads_layout{f[1], f[2], f[3], f[4]}};
}

// The kernel reads or writes [offset, offset + last element of the last token] of the tensor:
// a contiguous tensor must hold that range (the layout's own consistency is validate.h's rule);
// a strided view (q or k sliced from a fused projection) must be [b, s, heads, head_dim] with
// dense heads and the layout must be its own strides.
void check_extent(const paddle::Tensor& t, const HeadsView& view, int64_t batch, int64_t seq,
                  int64_t heads, int64_t head_dim, int slot) {
  const fastffn_heads_layout& l = view.layout;
  const int64_t tokens = batch * seq;
  PD_CHECK(l.heads_per_group > 0 && heads % l.heads_per_group == 0 && view.offset >= 0, kOp,
           ": the `", kSlotNames[slot], "` heads layout is invalid (heads_per_group ",
           l.heads_per_group, " for ", heads, " heads, offset ", view.offset, ")");
  if (!t.is_contiguous()) {
    const auto shape = t.shape();
    const auto strides = t.strides();
    PD_CHECK(shape.size() == 4 && shape[0] == batch && shape[1] == seq && shape[2] == heads &&
                 shape[3] == head_dim && strides[3] == 1 && strides[2] == head_dim &&
                 strides[0] == strides[1] * seq && view.offset == 0 &&
                 l.token_stride == strides[1] && l.heads_per_group == heads &&
                 l.head_stride == head_dim,
             kOp, ": argument `", kSlotNames[slot],
             "` must be dense within each token (the Python wrapper makes it so)");
    return;
  }
  if (tokens == 0) return;
  const int64_t groups = heads / l.heads_per_group;
  const int64_t last = view.offset + (tokens - 1) * l.token_stride + (groups - 1) * l.group_stride +
                       (l.heads_per_group - 1) * l.head_stride + head_dim;
  PD_CHECK(last <= t.numel(), kOp, ": argument `", kSlotNames[slot], "` (", t.numel(),
           " elements) is too small for its heads layout (needs ",
           last, ")");
}

void RotaryInPlace(const paddle::Tensor& q, const paddle::optional<paddle::Tensor>& k,
                   const paddle::optional<paddle::Tensor>& v, const paddle::Tensor& cos,
                   const paddle::Tensor& sin, const paddle::optional<paddle::Tensor>& position_ids,
                   paddle::Tensor& out, paddle::optional<paddle::Tensor>& k_out,
                   paddle::optional<paddle::Tensor>& v_out,
                   paddle::optional<paddle::Tensor>& position_error,
                   const std::vector<int64_t>& dims, const std::vector<int64_t>& layouts,
                   bool with_v, bool inverse) {
  PD_CHECK(dims.size() == 5 && layouts.size() == 6 * kLayoutFields, kOp,
           ": dims must be {batch, seq, q_heads, k_heads, head_dim} and layouts 6 x 5 integers");
  const paddle::Tensor& k_src = k ? *k : q;
  const paddle::Tensor& v_src = v ? *v : q;
  paddle::Tensor& k_dst = k_out ? *k_out : out;
  paddle::Tensor& v_dst = v_out ? *v_out : out;
  const paddle::Tensor* tensors[6] = {&q, &k_src, &v_src, &out, &k_dst, &v_dst};
  fastffn_rotary_args args;
  args.batch = dims[0];
  args.seq = dims[1];
  args.q_heads = dims[2];
  args.k_heads = dims[3];
  args.head_dim = dims[4];
  args.dtype = kernel_dtype(q, kOp, "q");
  const int64_t tokens = args.batch * args.seq;
  HeadsView views[6];
  for (int slot = 0; slot < 6; ++slot) {
    views[slot] = view_at(layouts, slot);
    if (!with_v && (slot == 2 || slot == 5)) continue;
    check_same_dtype(q, "q", *tensors[slot], kSlotNames[slot], kOp);
    check_same_place(q, *tensors[slot], kSlotNames[slot], kOp);
    check_extent(*tensors[slot], views[slot], args.batch, args.seq,
                 slot % 3 == 0 ? args.q_heads : args.k_heads, args.head_dim, slot);
  }
  args.q_in = views[0].layout;
  args.k_in = views[1].layout;
  args.v_in = views[2].layout;
  args.q_out = views[3].layout;
  args.k_out = views[4].layout;
  args.v_out = views[5].layout;
  for (const paddle::Tensor* t : {&cos, &sin}) {
    PD_CHECK(t->dtype() == paddle::DataType::FLOAT32 && t->shape().size() == 2 &&
                 t->shape()[1] == args.head_dim && t->is_contiguous(),
             kOp, ": cos/sin must be contiguous float32 [table_rows, head_dim]");
    check_same_place(q, *t, "cos/sin", kOp);
  }
  args.table_rows = cos.shape()[0];
  args.inverse = inverse ? 1 : 0;
  args.position_error = nullptr;
  const int64_t* pos = nullptr;
  if (position_ids) {
    PD_CHECK(position_ids->dtype() == paddle::DataType::INT64 && position_ids->is_contiguous() &&
                 position_ids->numel() == tokens,
             kOp, ": `position_ids` must be contiguous int64 [batch, seq]");
    check_same_place(q, *position_ids, "position_ids", kOp);
    pos = position_ids->data<int64_t>();
  }  // seq against the table, heads and head_dim: the C layer's rules (check_rotary)
  if (position_error) {
    PD_CHECK(position_error->dtype() == paddle::DataType::INT32 && position_error->numel() == 1,
             kOp, ": argument `position_error` must be one int32 (a zeroed flag)");
    check_same_place(q, *position_error, "position_error", kOp);
    args.position_error = position_error->data<int32_t>();
  }
  auto element = [&](const paddle::Tensor& t, int slot) -> char* {
    return static_cast<char*>(const_cast<void*>(t.data())) +
           views[slot].offset * static_cast<int64_t>(phi::SizeOf(t.dtype()));
  };
  const void* q_ptr = element(q, 0);
  const void* k_ptr = element(k_src, 1);
  const void* v_ptr = with_v ? element(v_src, 2) : nullptr;
  void* q_out_ptr = element(out, 3);
  void* k_out_ptr = element(k_dst, 4);
  void* v_out_ptr = with_v ? element(v_dst, 5) : nullptr;
  const fastffn_status status = run_on_device(
      q, kOp,
      [&] {
        return fastffn_rotary_cpu(args, q_ptr, k_ptr, v_ptr, cos.data<float>(), sin.data<float>(),
                                  pos, q_out_ptr, k_out_ptr, v_out_ptr);
      },
      [&](void* stream) {
        return fastffn_rotary_cuda(args, q_ptr, k_ptr, v_ptr, cos.data<float>(), sin.data<float>(),
                                   pos, q_out_ptr, k_out_ptr, v_out_ptr, stream);
      });
  // An out-of-table position on the CPU: the C layer's message names position_ids and the table.
  check_status(status, kOp);
}

}  // namespace

PD_BUILD_OP(fastffn_rotary)
    .Inputs({"Q", paddle::Optional("K"), paddle::Optional("V"), "Cos", "Sin",
             paddle::Optional("PositionIds"), "Out", paddle::Optional("KOut"),
             paddle::Optional("VOut"), paddle::Optional("PositionError")})
    .Outputs({"OutOut", paddle::Optional("KOutOut"), paddle::Optional("VOutOut"),
              paddle::Optional("PositionErrorOut")})
    .Attrs({"dims: std::vector<int64_t>", "layouts: std::vector<int64_t>", "with_v: bool",
            "inverse: bool"})
    .SetInplaceMap({{"Out", "OutOut"},
                    {paddle::Optional("KOut"), paddle::Optional("KOutOut")},
                    {paddle::Optional("VOut"), paddle::Optional("VOutOut")},
                    {paddle::Optional("PositionError"), paddle::Optional("PositionErrorOut")}})
    .SetKernelFn(PD_KERNEL(RotaryInPlace));
