// SwiGLU on the CPU: out = silu(gate) * up, fp32 math for every storage dtype, rows split across
// OpenMP threads, the inner loop vectorised (fast_expf is branch-free).
#include "cpu_common.h"
#include "../validate.h"

namespace fastffn {
namespace cpu {
namespace {

template <typename T>
void swiglu_fwd(const fastffn_swiglu_args& a, T* out, int64_t out_stride) {
  const T* gate = static_cast<const T*>(a.gate);
  const T* up = static_cast<const T*>(a.up);
#pragma omp parallel for schedule(static) num_threads(parallel_threads(a.rows * a.cols))
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* g = gate + r * a.gate_row_stride;
    const T* u = up + r * a.up_row_stride;
    T* o = out + r * out_stride;
#pragma omp simd
    for (int64_t c = 0; c < a.cols; ++c) {
      const auto gv = to_float(g[c]);
      o[c] = store<T>(gv * sigmoid(gv) * to_float(u[c]));
    }
  }
}

// d silu(g)/dg = sigmoid(g) * (1 + g * (1 - sigmoid(g))). One pass, so that the C API's in-place
// use (d_gate over gate, d_up over up, recomputed over d_out) is safe.
template <typename T, bool kRecompute>
void swiglu_bwd(const fastffn_swiglu_args& a, const T* d_out, int64_t d_out_stride, T* d_gate,
                int64_t d_gate_stride, T* d_up, int64_t d_up_stride, T* recomputed,
                int64_t recomputed_stride) {
  const T* gate = static_cast<const T*>(a.gate);
  const T* up = static_cast<const T*>(a.up);
#pragma omp parallel for schedule(static) num_threads(parallel_threads(a.rows * a.cols))
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* g = gate + r * a.gate_row_stride;
    const T* u = up + r * a.up_row_stride;
    const T* dy = d_out + r * d_out_stride;
    T* dg = d_gate + r * d_gate_stride;
    T* du = d_up + r * d_up_stride;
    T* h = kRecompute ? recomputed + r * recomputed_stride : nullptr;
#pragma omp simd
    for (int64_t c = 0; c < a.cols; ++c) {
      const auto gv = to_float(g[c]);
      const auto uv = to_float(u[c]);
      const auto dyv = to_float(dy[c]);
      const auto sig = sigmoid(gv);
      const auto silu = gv * sig;
      dg[c] = store<T>(dyv * uv * sig * (1.0f + gv * (1.0f - sig)));
      du[c] = store<T>(dyv * silu);
      if constexpr (kRecompute) h[c] = store<T>(silu * uv);
    }
  }
}

}  // namespace
}  // namespace cpu
}  // namespace fastffn

using namespace fastffn::cpu;

extern "C" fastffn_status fastffn_swiglu_fwd_cpu(fastffn_swiglu_args args, void* out,
                                                 int64_t out_row_stride) {
  FASTFFN_TRY_STATUS(fastffn::check_swiglu_fwd(__func__, args, out, out_row_stride, true));
  return dispatch_dtype(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    swiglu_fwd<T>(args, static_cast<T*>(out), out_row_stride);
  });
}

extern "C" fastffn_status fastffn_swiglu_bwd_cpu(fastffn_swiglu_args args, const void* d_out,
                                                 int64_t d_out_row_stride, void* d_gate,
                                                 int64_t d_gate_row_stride, void* d_up,
                                                 int64_t d_up_row_stride, void* recomputed_out,
                                                 int64_t recomputed_out_row_stride) {
  FASTFFN_TRY_STATUS(fastffn::check_swiglu_bwd(__func__, args, d_out, d_out_row_stride, d_gate,
                                               d_gate_row_stride, d_up, d_up_row_stride,
                                               recomputed_out, recomputed_out_row_stride, true));
  return dispatch_dtype(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto run = recomputed_out != nullptr ? swiglu_bwd<T, true> : swiglu_bwd<T, false>;
    run(args, static_cast<const T*>(d_out), d_out_row_stride, static_cast<T*>(d_gate),
        d_gate_row_stride, static_cast<T*>(d_up), d_up_row_stride, static_cast<T*>(recomputed_out),
        recomputed_out_row_stride);
  });
}
