// Calls every CPU entry point of the C API with one argument broken and prints, per call,
// "<case>\t<status>\t<fastffn_last_error()>" (tests/build_checks/test_c_api_errors.py reads it),
// then one successful call, after which the message must be empty.
#include <cstdint>
#include <cstdio>

#include "fastffn/c_api.h"
#include "fastffn/optimizer.h"

namespace {

void report(const char* name, fastffn_status status) {
  std::printf("%s\t%d\t%s\n", name, static_cast<int>(status), fastffn_last_error());
}

}  // namespace

int main() {
  float a[16] = {}, b[16] = {}, c[16] = {}, d[16] = {}, e[16] = {};
  float rstd[4] = {};

  fastffn_swiglu_args swiglu{a, b, 2, 4, 3, 4, FASTFFN_DTYPE_FLOAT32};  // gate stride 3 < cols 4
  report("swiglu_fwd", fastffn_swiglu_fwd_cpu(swiglu, c, 4));
  swiglu.gate_row_stride = 4;
  report("swiglu_bwd", fastffn_swiglu_bwd_cpu(swiglu, d, 4, e, 2, c, 4, nullptr, 0));
  swiglu.dtype = FASTFFN_DTYPE_FP8_E4M3;
  report("swiglu_dtype", fastffn_swiglu_fwd_cpu(swiglu, c, 4));

  fastffn_rms_norm_args norm{2, 0, 1e-6f, FASTFFN_DTYPE_FLOAT32};  // no columns
  report("rms_norm_fwd", fastffn_rms_norm_fwd_cpu(norm, a, nullptr, b, c, nullptr, rstd));
  norm.cols = 4;
  norm.epsilon = -1.f;
  report("rms_norm_bwd", fastffn_rms_norm_bwd_cpu(norm, a, b, rstd, c, nullptr, d, e));

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
  report("rotary", fastffn_rotary_cpu(rotary, a, b, nullptr, c, d, nullptr, e, a, nullptr));
  rotary.k_heads = 1;
  rotary.k_in = rotary.k_out = fastffn_heads_layout{2, 2, 1, 2};
  const int64_t positions[2] = {0, 7};  // 7 is outside the 4-row table
  report("rotary_positions", fastffn_rotary_cpu(rotary, a, b, nullptr, c, d, positions, e, a, nullptr));

  fastffn_cross_entropy_args ce{};
  ce.rows = 2;
  ce.vocab = 4;
  ce.row_stride = 3;  // below the vocabulary
  ce.ignore_index = -100;
  ce.grad_scale = 1.f;
  ce.dtype = FASTFFN_DTYPE_FLOAT32;
  const int64_t labels[2] = {1, 9};
  report("cross_entropy", fastffn_cross_entropy_cpu(ce, a, labels, rstd));
  ce.row_stride = 4;
  report("cross_entropy_labels", fastffn_cross_entropy_cpu(ce, a, labels, rstd));

  fastffn_adamw_args adamw{};
  adamw.n = 4;
  adamw.param_dtype = FASTFFN_DTYPE_FLOAT16;
  adamw.grad_dtype = FASTFFN_DTYPE_BFLOAT16;
  report("adamw", fastffn_adamw_cpu(adamw, a, b, nullptr, c, d));
  report("adamw_pows", fastffn_adamw_update_pows_cpu(0.9f, 0.999f, a, nullptr));

  fastffn_rms_norm_args good{2, 4, 1e-6f, FASTFFN_DTYPE_FLOAT32};
  report("ok", fastffn_rms_norm_fwd_cpu(good, a, nullptr, b, c, nullptr, rstd));
  return 0;
}
