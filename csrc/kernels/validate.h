// Argument checks shared by the CPU and CUDA entry points of the C API (host code, no framework
// headers): one definition of what each kernel accepts.
#pragma once

#include "fastffn/c_api.h"

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

// Shapes and strides only; position ids are range-checked by the CPU entry point and flagged
// through args.position_error by the CUDA kernel (they live on the device there).
inline bool rotary_valid(const fastffn_rotary_args& a, const void* q, const void* k,
                         const float* cos, const float* sin, const void* q_out, const void* k_out,
                         const int64_t* position_ids) {
  const int64_t q_width = a.q_heads * a.head_dim;
  const int64_t k_width = a.k_heads * a.head_dim;
  return q != nullptr && k != nullptr && cos != nullptr && sin != nullptr && q_out != nullptr &&
         k_out != nullptr && a.batch >= 0 && a.seq > 0 && a.head_dim > 0 && a.head_dim % 2 == 0 &&
         a.k_heads > 0 && a.q_heads % a.k_heads == 0 && a.table_rows > 0 &&
         a.q_token_stride >= q_width && a.k_token_stride >= k_width &&
         (a.q_out_token_stride == 0 || a.q_out_token_stride >= q_width) &&
         (a.k_out_token_stride == 0 || a.k_out_token_stride >= k_width) &&
         (position_ids != nullptr || a.seq <= a.table_rows);
}

}  // namespace fastffn
