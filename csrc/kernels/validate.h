// Argument checks shared by the CPU and CUDA entry points of the C API (host code, no framework
// headers): one definition of what each kernel accepts, and the message each rejection records
// for fastffn_last_error (as Transformer Engine's NVTE_CHECK does). Callers translate status and
// message into their framework's error and do not re-check these rules. Beside each check, the
// row of the struct it checks in the C API's layout table (abi.h).
#pragma once

#include <stdint.h>

#include "abi.h"
#include "fastffn/c_api.h"
#include "fastffn/optimizer.h"

namespace fastffn {

// Records "<entry>: <printf message>" as this thread's fastffn_last_error and returns `status`.
fastffn_status fail(fastffn_status status, const char* entry, const char* format, ...)
    __attribute__((format(printf, 3, 4)));
// Clears this thread's last error (a call that passed its checks) and returns OK.
fastffn_status ok();
const char* dtype_name(fastffn_dtype dtype);

// Returns from the enclosing function (which returns fastffn_status) with a recorded message
// when `cond` does not hold.
#define FASTFFN_CHECK(cond, status, entry, ...)                                          \
  do {                                                                                   \
    if (!(cond)) return ::fastffn::fail((status), (entry), __VA_ARGS__);                 \
  } while (0)
#define FASTFFN_CHECK_ARG(cond, entry, ...) \
  FASTFFN_CHECK(cond, FASTFFN_STATUS_INVALID_ARGUMENT, entry, __VA_ARGS__)
// Propagates a failed status (whose message is already recorded).
#define FASTFFN_TRY_STATUS(expr)                                  \
  do {                                                            \
    const fastffn_status fastffn_try_status_ = (expr);            \
    if (fastffn_try_status_ != FASTFFN_STATUS_OK) return fastffn_try_status_; \
  } while (0)

// The dtypes the 16/32-bit kernels store: float64 only on the CPU (for gradient checks).
inline fastffn_status check_storage_dtype(const char* entry, const char* arg, fastffn_dtype dtype,
                                          bool float64_ok) {
  const bool known = dtype == FASTFFN_DTYPE_FLOAT32 || dtype == FASTFFN_DTYPE_FLOAT16 ||
                     dtype == FASTFFN_DTYPE_BFLOAT16 || (float64_ok && dtype == FASTFFN_DTYPE_FLOAT64);
  FASTFFN_CHECK(known, FASTFFN_STATUS_UNSUPPORTED_DTYPE, entry,
                "%s is %s (%d); this kernel stores FLOAT32, FLOAT16, BFLOAT16%s", arg,
                dtype_name(dtype), static_cast<int>(dtype), float64_ok ? " or FLOAT64" : "");
  return ok();
}

FASTFFN_ABI_STRUCT(fastffn_swiglu_args, gate, up, rows, cols, gate_row_stride, up_row_stride, dtype);

inline fastffn_status check_swiglu_args(const char* entry, const fastffn_swiglu_args& a) {
  FASTFFN_CHECK_ARG(a.gate != nullptr && a.up != nullptr, entry, "args.gate and args.up must not be NULL");
  FASTFFN_CHECK_ARG(a.rows >= 0 && a.cols >= 0, entry, "rows (%lld) and cols (%lld) must be >= 0",
                    (long long)a.rows, (long long)a.cols);
  FASTFFN_CHECK_ARG(a.gate_row_stride >= a.cols && a.up_row_stride >= a.cols, entry,
                    "gate_row_stride (%lld) and up_row_stride (%lld) must be >= cols (%lld)",
                    (long long)a.gate_row_stride, (long long)a.up_row_stride, (long long)a.cols);
  return ok();
}

// An output (or gradient input) of [rows, cols] with its own row stride.
inline fastffn_status check_swiglu_matrix(const char* entry, const char* arg, const void* data,
                                          int64_t row_stride, int64_t cols) {
  FASTFFN_CHECK_ARG(data != nullptr, entry, "%s must not be NULL", arg);
  FASTFFN_CHECK_ARG(row_stride >= cols, entry, "the row stride of %s (%lld) must be >= cols (%lld)",
                    arg, (long long)row_stride, (long long)cols);
  return ok();
}

inline fastffn_status check_swiglu_fwd(const char* entry, const fastffn_swiglu_args& a,
                                       const void* out, int64_t out_row_stride, bool float64_ok) {
  FASTFFN_TRY_STATUS(check_swiglu_args(entry, a));
  FASTFFN_TRY_STATUS(check_swiglu_matrix(entry, "out", out, out_row_stride, a.cols));
  return check_storage_dtype(entry, "args.dtype", a.dtype, float64_ok);
}

inline fastffn_status check_swiglu_bwd(const char* entry, const fastffn_swiglu_args& a,
                                       const void* d_out, int64_t d_out_row_stride,
                                       const void* d_gate, int64_t d_gate_row_stride,
                                       const void* d_up, int64_t d_up_row_stride,
                                       const void* recomputed_out,
                                       int64_t recomputed_out_row_stride, bool float64_ok) {
  FASTFFN_TRY_STATUS(check_swiglu_args(entry, a));
  FASTFFN_TRY_STATUS(check_swiglu_matrix(entry, "d_out", d_out, d_out_row_stride, a.cols));
  FASTFFN_TRY_STATUS(check_swiglu_matrix(entry, "d_gate", d_gate, d_gate_row_stride, a.cols));
  FASTFFN_TRY_STATUS(check_swiglu_matrix(entry, "d_up", d_up, d_up_row_stride, a.cols));
  if (recomputed_out != nullptr)
    FASTFFN_TRY_STATUS(check_swiglu_matrix(entry, "recomputed_out", recomputed_out,
                                           recomputed_out_row_stride, a.cols));
  return check_storage_dtype(entry, "args.dtype", a.dtype, float64_ok);
}

FASTFFN_ABI_STRUCT(fastffn_rms_norm_args, rows, cols, epsilon, dtype);
FASTFFN_ABI_STRUCT(fastffn_rms_norm_bwd_plan, blocks, shared_bytes, shared_partials, workspace_bytes);

inline fastffn_status check_rms_norm_shape(const char* entry, const fastffn_rms_norm_args& a,
                                           bool float64_ok) {
  FASTFFN_CHECK_ARG(a.rows >= 0, entry, "rows must be >= 0, got %lld", (long long)a.rows);
  FASTFFN_CHECK_ARG(a.cols > 0, entry, "cols (the normalised width) must be > 0, got %lld",
                    (long long)a.cols);
  FASTFFN_CHECK_ARG(a.epsilon >= 0.f, entry, "epsilon must be a non-negative float, got %g",
                    static_cast<double>(a.epsilon));
  return check_storage_dtype(entry, "args.dtype", a.dtype, float64_ok);
}

inline fastffn_status check_rms_norm_fwd(const char* entry, const fastffn_rms_norm_args& a,
                                         const void* x, const void* residual, const void* weight,
                                         const void* out, const void* sum_out, const float* rstd,
                                         bool float64_ok) {
  FASTFFN_CHECK_ARG(x != nullptr && weight != nullptr && out != nullptr && rstd != nullptr, entry,
                    "x, weight, out and rstd must not be NULL");
  FASTFFN_CHECK_ARG(residual == nullptr || sum_out != nullptr, entry,
                    "a residual needs sum_out (the fused add's output)");
  return check_rms_norm_shape(entry, a, float64_ok);
}

inline fastffn_status check_rms_norm_bwd(const char* entry, const fastffn_rms_norm_args& a,
                                         const void* x, const void* weight, const float* rstd,
                                         const void* d_out, const void* d_x, const void* d_weight,
                                         bool float64_ok) {
  FASTFFN_CHECK_ARG(x != nullptr && weight != nullptr && rstd != nullptr && d_out != nullptr &&
                        d_x != nullptr && d_weight != nullptr,
                    entry, "x, weight, rstd, d_out, d_x and d_weight must not be NULL");
  return check_rms_norm_shape(entry, a, float64_ok);
}

FASTFFN_ABI_STRUCT(fastffn_heads_layout, token_stride, group_stride, heads_per_group, head_stride);
FASTFFN_ABI_STRUCT(fastffn_rotary_args, batch, seq, q_heads, k_heads, head_dim, q_in, k_in, v_in, q_out,
    k_out, v_out, table_rows, inverse, dtype, position_error);

// One tensor's head addressing (fastffn_heads_layout in c_api.h): heads_per_group divides heads,
// the heads of a group and the groups of a token do not overlap, and a token's heads fit in its
// token stride.
inline fastffn_status check_heads_layout(const char* entry, const char* arg, const fastffn_heads_layout& l,
                                         int64_t heads, int64_t head_dim) {
  FASTFFN_CHECK_ARG(l.heads_per_group > 0 && heads % l.heads_per_group == 0, entry,
                    "%s: heads_per_group (%lld) must be > 0 and divide its %lld heads", arg,
                    (long long)l.heads_per_group, (long long)heads);
  FASTFFN_CHECK_ARG(l.head_stride >= 0 && l.group_stride >= 0, entry,
                    "%s: head_stride (%lld) and group_stride (%lld) must be >= 0", arg,
                    (long long)l.head_stride, (long long)l.group_stride);
  const int64_t groups = heads / l.heads_per_group;
  const int64_t group_extent = (l.heads_per_group - 1) * l.head_stride + head_dim;
  FASTFFN_CHECK_ARG(l.heads_per_group == 1 || l.head_stride >= head_dim, entry,
                    "%s: head_stride (%lld) must be >= head_dim (%lld): heads would overlap", arg,
                    (long long)l.head_stride, (long long)head_dim);
  FASTFFN_CHECK_ARG(groups == 1 || l.group_stride >= group_extent, entry,
                    "%s: group_stride (%lld) must be >= a group's extent (%lld): groups would overlap", arg,
                    (long long)l.group_stride, (long long)group_extent);
  FASTFFN_CHECK_ARG(l.token_stride >= (groups - 1) * l.group_stride + group_extent, entry,
                    "%s: token_stride (%lld) must hold a token's heads (%lld elements)", arg,
                    (long long)l.token_stride, (long long)((groups - 1) * l.group_stride + group_extent));
  return ok();
}

// Shapes and strides only; position ids are range-checked by the entry points (see c_api.h).
inline fastffn_status check_rotary(const char* entry, const fastffn_rotary_args& a, const void* q,
                                   const void* k, const void* v, const float* cos, const float* sin,
                                   const void* q_out, const void* k_out, const void* v_out,
                                   const int64_t* position_ids, bool float64_ok) {
  FASTFFN_CHECK_ARG(q != nullptr && k != nullptr && cos != nullptr && sin != nullptr &&
                        q_out != nullptr && k_out != nullptr,
                    entry, "q, k, cos, sin, q_out and k_out must not be NULL");
  FASTFFN_CHECK_ARG((v == nullptr) == (v_out == nullptr), entry,
                    "v and v_out must both be given (the fused QKV path) or both be NULL");
  FASTFFN_CHECK_ARG(a.batch >= 0 && a.seq > 0, entry, "batch must be >= 0 and seq > 0, got %lld, %lld",
                    (long long)a.batch, (long long)a.seq);
  FASTFFN_CHECK_ARG(a.head_dim > 0 && a.head_dim % 2 == 0, entry,
                    "head_dim must be even and > 0, got %lld", (long long)a.head_dim);
  FASTFFN_CHECK_ARG(a.k_heads > 0 && a.q_heads > 0 && a.q_heads % a.k_heads == 0, entry,
                    "k heads (%lld) must divide q heads (%lld)", (long long)a.k_heads,
                    (long long)a.q_heads);
  FASTFFN_CHECK_ARG(a.table_rows > 0, entry, "the cos/sin table must have rows, got %lld",
                    (long long)a.table_rows);
  FASTFFN_CHECK_ARG(position_ids != nullptr || a.seq <= a.table_rows, entry,
                    "seq (%lld) exceeds the cos/sin table (%lld rows)", (long long)a.seq,
                    (long long)a.table_rows);
  FASTFFN_TRY_STATUS(check_heads_layout(entry, "q_in", a.q_in, a.q_heads, a.head_dim));
  FASTFFN_TRY_STATUS(check_heads_layout(entry, "k_in", a.k_in, a.k_heads, a.head_dim));
  FASTFFN_TRY_STATUS(check_heads_layout(entry, "q_out", a.q_out, a.q_heads, a.head_dim));
  FASTFFN_TRY_STATUS(check_heads_layout(entry, "k_out", a.k_out, a.k_heads, a.head_dim));
  if (v != nullptr) {
    FASTFFN_TRY_STATUS(check_heads_layout(entry, "v_in", a.v_in, a.k_heads, a.head_dim));
    FASTFFN_TRY_STATUS(check_heads_layout(entry, "v_out", a.v_out, a.k_heads, a.head_dim));
  }
  return check_storage_dtype(entry, "args.dtype", a.dtype, float64_ok);
}

FASTFFN_ABI_STRUCT(fastffn_cross_entropy_args, rows, vocab, row_stride, ignore_index, grad_scale,
    with_grad, dtype, label_error);

inline fastffn_status check_cross_entropy(const char* entry, const fastffn_cross_entropy_args& a,
                                          const void* logits, const int64_t* labels,
                                          const float* loss, bool float64_ok) {
  FASTFFN_CHECK_ARG(logits != nullptr && labels != nullptr && loss != nullptr, entry,
                    "logits, labels and loss must not be NULL");
  FASTFFN_CHECK_ARG(a.rows >= 0, entry, "rows must be >= 0, got %lld", (long long)a.rows);
  FASTFFN_CHECK_ARG(a.vocab > 0, entry, "the vocabulary (logits' last axis) must not be empty");
  FASTFFN_CHECK_ARG(a.row_stride >= a.vocab, entry, "row_stride (%lld) must be >= vocab (%lld)",
                    (long long)a.row_stride, (long long)a.vocab);
  return check_storage_dtype(entry, "args.dtype (of the logits)", a.dtype, float64_ok);
}

FASTFFN_ABI_STRUCT(fastffn_scalar, value, ptr);
FASTFFN_ABI_STRUCT(fastffn_adamw_args, n, param_dtype, grad_dtype, beta1, beta2, epsilon, coeff,
    lr_ratio, with_decay, lr, beta1_pow, beta2_pow, grad_scale);

// AdamW: INVALID_ARGUMENT for missing tensors or n < 0, UNSUPPORTED_DTYPE for dtypes outside
// fastffn/optimizer.h's contract (checked in that order).
inline fastffn_status check_adamw(const char* entry, const fastffn_adamw_args& a,
                                  const void* param, const void* grad, const void* moment1,
                                  const void* moment2) {
  FASTFFN_CHECK_ARG(param != nullptr && grad != nullptr && moment1 != nullptr && moment2 != nullptr,
                    entry, "param, grad, moment1 and moment2 must not be NULL");
  FASTFFN_CHECK_ARG(a.n >= 0, entry, "n must be >= 0, got %lld", (long long)a.n);
  FASTFFN_TRY_STATUS(check_storage_dtype(entry, "param_dtype", a.param_dtype, false));
  FASTFFN_CHECK(a.grad_dtype == a.param_dtype || a.grad_dtype == FASTFFN_DTYPE_FLOAT32,
                FASTFFN_STATUS_UNSUPPORTED_DTYPE, entry,
                "grad_dtype is %s; it must be the param's dtype (%s) or FLOAT32",
                dtype_name(a.grad_dtype), dtype_name(a.param_dtype));
  return ok();
}

FASTFFN_ABI_ENUM(fastffn_moments);
FASTFFN_ABI_STRUCT(fastffn_adamw_state, moments, moment1, moment2, absmax1, absmax2, master, compensation,
                   param_amax);

// fastffn_adamw_with_state_*: check_adamw's rules, then the state layout's (fastffn/optimizer.h).
inline fastffn_status check_adamw_state(const char* entry, const fastffn_adamw_args& a,
                                        const void* param, const void* grad,
                                        const fastffn_adamw_state& s) {
  FASTFFN_TRY_STATUS(check_adamw(entry, a, param, grad, s.moment1, s.moment2));
  const bool absmax_given = s.absmax1 != nullptr || s.absmax2 != nullptr;
  switch (s.moments) {
    case FASTFFN_MOMENTS_FLOAT32:
      FASTFFN_CHECK_ARG(!absmax_given, entry, "absmax1 and absmax2 must be NULL for FLOAT32 moments");
      break;
    case FASTFFN_MOMENTS_BLOCKWISE_8BIT:
      FASTFFN_CHECK_ARG(s.absmax1 != nullptr && s.absmax2 != nullptr, entry,
                        "absmax1 and absmax2 must not be NULL for BLOCKWISE_8BIT moments");
      break;
    default:
      return fail(FASTFFN_STATUS_INVALID_ARGUMENT, entry, "moments is %d, not a fastffn_moments value",
                  static_cast<int>(s.moments));
  }
  FASTFFN_CHECK_ARG(s.master == nullptr || s.compensation == nullptr, entry,
                    "master and compensation exclude each other");
  FASTFFN_CHECK_ARG(s.param_amax == nullptr ||
                        (s.param_amax != param && s.param_amax != grad && s.param_amax != s.master &&
                         s.param_amax != s.compensation && s.param_amax != s.moment1 &&
                         s.param_amax != s.moment2 && s.param_amax != s.absmax1 && s.param_amax != s.absmax2),
                    entry, "param_amax must not alias the parameter or its state");
  FASTFFN_CHECK(s.compensation == nullptr || a.param_dtype != FASTFFN_DTYPE_FLOAT32,
                FASTFFN_STATUS_UNSUPPORTED_DTYPE, entry,
                "compensation needs a FLOAT16 or BFLOAT16 param, got FLOAT32");
  return ok();
}

inline fastffn_status check_adamw_pows(const char* entry, const float* beta1_pow,
                                       const float* beta2_pow) {
  FASTFFN_CHECK_ARG(beta1_pow != nullptr && beta2_pow != nullptr, entry,
                    "beta1_pow and beta2_pow must not be NULL");
  return ok();
}

}  // namespace fastffn
