// Argument checks shared by the CPU and CUDA entry points of the C API (host code, no framework
// headers): one definition of what each kernel accepts.
#pragma once

#include "fastffn/c_api.h"
#include "fastffn/optimizer.h"

namespace fastffn {

inline bool swiglu_args_valid(const fastffn_swiglu_args& a) {
  return a.gate != nullptr && a.up != nullptr && a.rows >= 0 && a.cols >= 0 &&
         a.gate_row_stride >= a.cols && a.up_row_stride >= a.cols;
}

inline bool rms_norm_fwd_valid(const fastffn_rms_norm_args& a, const void* x, const void* residual,
                               const void* weight, const void* out, const void* sum_out,
                               const float* rstd) {
  return x != nullptr && weight != nullptr && out != nullptr && rstd != nullptr && a.rows >= 0 &&
         a.cols > 0 && (residual == nullptr || sum_out != nullptr);
}

inline bool rms_norm_bwd_valid(const fastffn_rms_norm_args& a, const void* x, const void* weight,
                               const float* rstd, const void* d_out, const void* d_x,
                               const void* d_weight) {
  return x != nullptr && weight != nullptr && rstd != nullptr && d_out != nullptr &&
         d_x != nullptr && d_weight != nullptr && a.rows >= 0 && a.cols > 0;
}

// One tensor's head addressing (fastffn_heads_layout in c_api.h): heads_per_group divides heads,
// the heads of a group and the groups of a token do not overlap, and a token's heads fit in its
// token stride.
inline bool heads_layout_valid(const fastffn_heads_layout& l, int64_t heads, int64_t head_dim) {
  if (l.heads_per_group <= 0 || heads % l.heads_per_group != 0 || l.head_stride < 0 ||
      l.group_stride < 0)
    return false;
  const int64_t groups = heads / l.heads_per_group;
  const int64_t group_extent = (l.heads_per_group - 1) * l.head_stride + head_dim;
  return (l.heads_per_group == 1 || l.head_stride >= head_dim) &&
         (groups == 1 || l.group_stride >= group_extent) &&
         l.token_stride >= (groups - 1) * l.group_stride + group_extent;
}

// Shapes and strides only; position ids are range-checked by the entry points (see c_api.h).
inline bool rotary_valid(const fastffn_rotary_args& a, const void* q, const void* k, const void* v,
                         const float* cos, const float* sin, const void* q_out, const void* k_out,
                         const void* v_out, const int64_t* position_ids) {
  const bool with_v = v != nullptr;
  return q != nullptr && k != nullptr && cos != nullptr && sin != nullptr && q_out != nullptr &&
         k_out != nullptr && (v_out != nullptr) == with_v && a.batch >= 0 && a.seq > 0 &&
         a.head_dim > 0 && a.head_dim % 2 == 0 && a.k_heads > 0 && a.q_heads > 0 &&
         a.q_heads % a.k_heads == 0 && a.table_rows > 0 &&
         (position_ids != nullptr || a.seq <= a.table_rows) &&
         heads_layout_valid(a.q_in, a.q_heads, a.head_dim) &&
         heads_layout_valid(a.k_in, a.k_heads, a.head_dim) &&
         heads_layout_valid(a.q_out, a.q_heads, a.head_dim) &&
         heads_layout_valid(a.k_out, a.k_heads, a.head_dim) &&
         (!with_v || (heads_layout_valid(a.v_in, a.k_heads, a.head_dim) &&
                      heads_layout_valid(a.v_out, a.k_heads, a.head_dim)));
}

// AdamW: INVALID_ARGUMENT for missing tensors or n < 0, UNSUPPORTED_DTYPE for dtypes outside
// fastffn/optimizer.h's contract (checked in that order).
inline fastffn_status adamw_args_status(const fastffn_adamw_args& a, const void* param,
                                        const void* grad, const float* moment1,
                                        const float* moment2) {
  if (param == nullptr || grad == nullptr || moment1 == nullptr || moment2 == nullptr || a.n < 0)
    return FASTFFN_STATUS_INVALID_ARGUMENT;
  const bool param_ok = a.param_dtype == FASTFFN_DTYPE_FLOAT32 ||
                        a.param_dtype == FASTFFN_DTYPE_FLOAT16 ||
                        a.param_dtype == FASTFFN_DTYPE_BFLOAT16;
  const bool grad_ok = a.grad_dtype == a.param_dtype || a.grad_dtype == FASTFFN_DTYPE_FLOAT32;
  return param_ok && grad_ok ? FASTFFN_STATUS_OK : FASTFFN_STATUS_UNSUPPORTED_DTYPE;
}

}  // namespace fastffn
