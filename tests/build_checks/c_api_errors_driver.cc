// Calls every CPU entry point of the C API with one argument broken and prints, per call,
// "<case>\t<status>\t<fastffn_last_error()>\t<expected status>\t<expected message>"
// (tests/build_checks/test_c_api_errors.py reads it and checks that every CPU entry point the
// headers declare is called here), then one successful call, after which the message must be empty.
#include <cstdint>
#include <cstdio>

#include "fastffn/c_api.h"
#include "fastffn/optimizer.h"

namespace {

// One line per case: name, the status and message the call gave, the ones it must give.
void expect(const char* name, fastffn_status status, fastffn_status want_status, const char* want_message) {
  std::printf("%s\t%d\t%s\t%d\t%s\n", name, static_cast<int>(status), fastffn_last_error(),
              static_cast<int>(want_status), want_message);
}

}  // namespace

int main() {
  float a[16] = {}, b[16] = {}, c[16] = {}, d[16] = {}, e[16] = {};
  float rstd[4] = {};

  fastffn_swiglu_args swiglu{a, b, 2, 4, 3, 4, FASTFFN_DTYPE_FLOAT32};  // gate stride 3 < cols 4
  expect("swiglu_fwd", fastffn_swiglu_fwd_cpu(swiglu, c, 4),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_swiglu_fwd_cpu: gate_row_stride (3) and up_row_stride (4) "
         "must be >= cols (4)");
  swiglu.gate_row_stride = 4;
  expect("swiglu_bwd", fastffn_swiglu_bwd_cpu(swiglu, d, 4, e, 2, c, 4, nullptr, 0),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_swiglu_bwd_cpu: the row stride of d_gate (2) must be >= cols "
         "(4)");
  swiglu.dtype = FASTFFN_DTYPE_FP8_E4M3;
  expect("swiglu_dtype", fastffn_swiglu_fwd_cpu(swiglu, c, 4),
         FASTFFN_STATUS_UNSUPPORTED_DTYPE,
         "fastffn_swiglu_fwd_cpu: args.dtype is FP8_E4M3 (4); this kernel "
         "stores FLOAT32, FLOAT16, BFLOAT16 or FLOAT64");

  fastffn_rms_norm_args norm{2, 0, 1e-6f, FASTFFN_DTYPE_FLOAT32};  // no columns
  expect("rms_norm_fwd", fastffn_rms_norm_fwd_cpu(norm, a, nullptr, b, c, nullptr, rstd),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_rms_norm_fwd_cpu: cols (the normalised width) must be > 0, "
         "got 0");
  norm.cols = 4;
  norm.epsilon = -1.f;
  expect("rms_norm_bwd", fastffn_rms_norm_bwd_cpu(norm, a, b, rstd, c, nullptr, d, e),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_rms_norm_bwd_cpu: epsilon must be a non-negative float, got -1");

  fastffn_rotary_args rotary{};
  rotary.batch = 1;
  rotary.seq = 2;
  rotary.q_heads = 3;
  rotary.k_heads = 2;  // does not divide 3
  rotary.head_dim = 2;
  rotary.q_in = rotary.q_out = fastffn_heads_layout{6, 6, 3, 2};  // dense [b, s, heads, head_dim]
  rotary.k_in = rotary.k_out = fastffn_heads_layout{4, 4, 2, 2};
  rotary.table_rows = 4;
  rotary.dtype = FASTFFN_DTYPE_FLOAT32;
  expect("rotary", fastffn_rotary_cpu(rotary, a, b, nullptr, c, d, nullptr, e, a, nullptr),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_rotary_cpu: k heads (2) must divide q heads (3)");
  rotary.k_heads = 1;
  rotary.k_in = rotary.k_out = fastffn_heads_layout{2, 2, 1, 2};
  const int64_t positions[2] = {0, 7};  // 7 is outside the 4-row table
  expect("rotary_positions", fastffn_rotary_cpu(rotary, a, b, nullptr, c, d, positions, e, a, nullptr),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_rotary_cpu: position_ids[1] is 7, outside the cos/sin table "
         "[0, 4)");

  fastffn_cross_entropy_args ce{};
  ce.rows = 2;
  ce.vocab = 4;
  ce.row_stride = 3;  // below the vocabulary
  ce.ignore_index = -100;
  ce.grad_scale = 1.f;
  ce.dtype = FASTFFN_DTYPE_FLOAT32;
  const int64_t labels[2] = {1, 9};
  expect("cross_entropy", fastffn_cross_entropy_cpu(ce, a, labels, rstd),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_cross_entropy_cpu: row_stride (3) must be >= vocab (4)");
  ce.row_stride = 4;
  expect("cross_entropy_labels", fastffn_cross_entropy_cpu(ce, a, labels, rstd),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_cross_entropy_cpu: labels holds 9 (row 1 of this call), "
         "outside the vocabulary [0, 4) and not ignore_index (-100)");

  fastffn_adamw_args adamw{};
  adamw.n = 4;
  adamw.param_dtype = FASTFFN_DTYPE_FLOAT16;
  adamw.grad_dtype = FASTFFN_DTYPE_BFLOAT16;
  expect("adamw", fastffn_adamw_cpu(adamw, a, b, nullptr, c, d),
         FASTFFN_STATUS_UNSUPPORTED_DTYPE,
         "fastffn_adamw_cpu: grad_dtype is BFLOAT16; it must be the param's "
         "dtype (FLOAT16) or FLOAT32");
  adamw.grad_dtype = FASTFFN_DTYPE_FLOAT16;
  fastffn_adamw_state both{FASTFFN_MOMENTS_FLOAT32, c, d, nullptr, nullptr, a, b};
  expect("adamw_master_and_compensation", fastffn_adamw_with_state_cpu(adamw, a, b, both),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_adamw_with_state_cpu: master and compensation exclude each other");
  fastffn_adamw_state no_absmax{FASTFFN_MOMENTS_BLOCKWISE_8BIT, c, d, nullptr, nullptr, nullptr,
                                nullptr};
  expect("adamw_8bit_without_absmax", fastffn_adamw_with_state_cpu(adamw, a, b, no_absmax),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_adamw_with_state_cpu: absmax1 and absmax2 must not be NULL for BLOCKWISE_8BIT "
         "moments");
  adamw.param_dtype = adamw.grad_dtype = FASTFFN_DTYPE_FLOAT32;
  fastffn_adamw_state fp32_compensated{FASTFFN_MOMENTS_FLOAT32, c, d, nullptr, nullptr, nullptr, b};
  expect("adamw_compensated_fp32", fastffn_adamw_with_state_cpu(adamw, a, b, fp32_compensated),
         FASTFFN_STATUS_UNSUPPORTED_DTYPE,
         "fastffn_adamw_with_state_cpu: compensation needs a FLOAT16 or BFLOAT16 param, got FLOAT32");
  expect("adamw_pows", fastffn_adamw_update_pows_cpu(0.9f, 0.999f, a, nullptr),
         FASTFFN_STATUS_INVALID_ARGUMENT,
         "fastffn_adamw_update_pows_cpu: beta1_pow and beta2_pow must not be "
         "NULL");

  fastffn_rms_norm_args good{2, 4, 1e-6f, FASTFFN_DTYPE_FLOAT32};
  expect("ok", fastffn_rms_norm_fwd_cpu(good, a, nullptr, b, c, nullptr, rstd),
         FASTFFN_STATUS_OK,
         "");
  return 0;
}
