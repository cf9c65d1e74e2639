// RMSNorm (optionally fused with the residual add before it) on the CPU. Numerics follow
// PaddleNLP's LlamaRMSNorm: statistics in fp32, the normalised row rounded to the weight dtype
// before the weight multiply. One row per OpenMP iteration; the weight gradient is reduced in
// fp32 per thread, then across threads.
#include <omp.h>

#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "../validate.h"

namespace fastffn {
namespace cpu {
namespace {

template <typename T>
void rms_norm_fwd(const fastffn_rms_norm_args& a, const T* x, const T* residual, const T* weight,
                  T* out, T* sum_out, float* rstd) {
  const int64_t n = a.cols;
#pragma omp parallel for schedule(static) num_threads(parallel_threads(a.rows * n))
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = x + r * n;
    T* outr = out + r * n;
    compute_t<T> sq = 0;
    if (residual != nullptr) {
      // The sum is what the unfused add would have stored: rounded to T, then normalised.
      const T* res = residual + r * n;
      T* sr = sum_out + r * n;
#pragma omp simd reduction(+ : sq)
      for (int64_t c = 0; c < n; ++c) {
        const T s = store<T>(to_float(xr[c]) + to_float(res[c]));
        sr[c] = s;
        const auto sv = to_float(s);
        sq += sv * sv;
      }
      xr = sr;
    } else {
#pragma omp simd reduction(+ : sq)
      for (int64_t c = 0; c < n; ++c) {
        const auto v = to_float(xr[c]);
        sq += v * v;
      }
    }
    const compute_t<T> inv = 1 / std::sqrt(sq / static_cast<compute_t<T>>(n) + a.epsilon);
    rstd[r] = inv;
#pragma omp simd
    for (int64_t c = 0; c < n; ++c)
      outr[c] = store<T>(round_to_storage<T>(to_float(xr[c]) * inv) * to_float(weight[c]));
  }
}

template <typename T>
void rms_norm_bwd(const fastffn_rms_norm_args& a, const T* x, const T* weight, const float* rstd,
                  const T* d_out, const T* d_sum, T* d_x, T* d_weight) {
  const int64_t n = a.cols;
  const int threads = parallel_threads(a.rows * n);
  std::vector<compute_t<T>> partial(static_cast<size_t>(threads) * n, 0.f);
  std::vector<compute_t<T>> w(n);
  for (int64_t c = 0; c < n; ++c) w[c] = to_float(weight[c]);
#pragma omp parallel num_threads(threads)
  {
    compute_t<T>* dw = partial.data() + static_cast<size_t>(omp_get_thread_num()) * n;
    std::vector<compute_t<T>> g(n);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      const T* xr = x + r * n;
      const T* dy = d_out + r * n;
      compute_t<T> inv = rstd[r];
      if constexpr (std::is_same_v<T, double>) {  // rstd is stored in fp32; fp64 checks need more
        double sq = 0;
        for (int64_t c = 0; c < n; ++c) sq += xr[c] * xr[c];
        inv = 1 / std::sqrt(sq / n + a.epsilon);
      }
      compute_t<T> dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < n; ++c) {
        const auto xn = to_float(xr[c]) * inv;
        const auto dyv = to_float(dy[c]);
        dw[c] += dyv * round_to_storage<T>(xn);
        g[c] = dyv * w[c];
        dot += g[c] * xn;
      }
      const compute_t<T> mean_dot = dot / static_cast<compute_t<T>>(n);
      T* dxr = d_x + r * n;
      const T* dsr = d_sum ? d_sum + r * n : nullptr;
      if (dsr != nullptr) {
#pragma omp simd
        for (int64_t c = 0; c < n; ++c)
          dxr[c] = store<T>(inv * (g[c] - to_float(xr[c]) * inv * mean_dot) + to_float(dsr[c]));
      } else {
#pragma omp simd
        for (int64_t c = 0; c < n; ++c)
          dxr[c] = store<T>(inv * (g[c] - to_float(xr[c]) * inv * mean_dot));
      }
    }
  }
  for (int64_t c = 0; c < n; ++c) {
    compute_t<T> acc = 0;
    for (int t = 0; t < threads; ++t) acc += partial[static_cast<size_t>(t) * n + c];
    d_weight[c] = store<T>(acc);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace fastffn

using namespace fastffn::cpu;

extern "C" fastffn_status fastffn_rms_norm_fwd_cpu(fastffn_rms_norm_args args, const void* x,
                                                   const void* residual, const void* weight,
                                                   void* out, void* sum_out, float* rstd) {
  FASTFFN_TRY_STATUS(
      fastffn::check_rms_norm_fwd(__func__, args, x, residual, weight, out, sum_out, rstd, true));
  return dispatch_dtype(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_fwd<T>(args, static_cast<const T*>(x), static_cast<const T*>(residual),
                    static_cast<const T*>(weight), static_cast<T*>(out), static_cast<T*>(sum_out),
                    rstd);
  });
}

extern "C" fastffn_status fastffn_rms_norm_bwd_cpu(fastffn_rms_norm_args args, const void* x,
                                                   const void* weight, const float* rstd,
                                                   const void* d_out, const void* d_sum, void* d_x,
                                                   void* d_weight) {
  FASTFFN_TRY_STATUS(
      fastffn::check_rms_norm_bwd(__func__, args, x, weight, rstd, d_out, d_x, d_weight, true));
  return dispatch_dtype(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_bwd<T>(args, static_cast<const T*>(x), static_cast<const T*>(weight), rstd,
                    static_cast<const T*>(d_out), static_cast<const T*>(d_sum),
                    static_cast<T*>(d_x), static_cast<T*>(d_weight));
  });
}
