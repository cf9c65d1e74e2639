// The AdamW update of fastffn/optimizer.h, written once for the CPU (g++) and CUDA (nvcc) kernels
// so that both run the same operations in the same order: Paddle's CUDA adamw kernel
// (AdamWKernelREG), fp32 throughout.
#pragma once

#include <cmath>
#include <stdint.h>

#include "fastffn/optimizer.h"

#if defined(__CUDACC__)
#define FASTFFN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTFFN_HOST_DEVICE inline
#endif

namespace fastffn {

// IEEE round-to-nearest sqrt and division: the CUDA build uses --use_fast_math, which would turn
// sqrtf and '/' into approximations that Paddle's kernel does not use.
FASTFFN_HOST_DEVICE float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

FASTFFN_HOST_DEVICE float div_rn(float x, float y) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(x, y);
#else
  return x / y;
#endif
}

// What a launch computes once from the scalars (each thread of a CUDA launch computes it from
// the same values, so every element sees the same bits).
struct AdamwStep {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, epsilon;
  float decay;             // 1 - lr * coeff
  float step;              // -(lr / (1 - beta1_pow))
  float bias_correction2;  // sqrt(1 - beta2_pow)
  float grad_scale;
};

FASTFFN_HOST_DEVICE AdamwStep adamw_step(const fastffn_adamw_args& a, float lr, float beta1_pow,
                                         float beta2_pow, float grad_scale) {
  const float rate = lr * a.lr_ratio;
  const float coeff = a.with_decay ? a.coeff : 0.f;
  AdamwStep s;
  s.beta1 = a.beta1;
  s.beta2 = a.beta2;
  s.one_minus_beta1 = 1.f - a.beta1;
  s.one_minus_beta2 = 1.f - a.beta2;
  s.epsilon = a.epsilon;
  s.decay = 1.f - rate * coeff;
  s.step = -div_rn(rate, 1.f - beta1_pow);
  s.bias_correction2 = sqrt_rn(1.f - beta2_pow);
  s.grad_scale = grad_scale;
  return s;
}

// One element: p (the master value, or the parameter upcast) and the moments in place.
// Multiplying by grad_scale = 1 leaves every gradient bit unchanged (NaN and Inf included).
FASTFFN_HOST_DEVICE void adamw_update(const AdamwStep& s, float& p, float grad, float& m1,
                                      float& m2) {
  const float g = grad * s.grad_scale;
  p *= s.decay;
  m1 = s.beta1 * m1 + s.one_minus_beta1 * g;
  m2 = s.beta2 * m2 + s.one_minus_beta2 * g * g;
  const float denom = div_rn(sqrt_rn(m2), s.bias_correction2) + s.epsilon;
  p += div_rn(m1, denom) * s.step;
}

// Where an element's fp32 weight comes from and goes to (fastffn_adamw_state): the parameter
// itself, the fp32 master, or the parameter plus its Kahan compensation.
enum class Weight { kParam, kMaster, kCompensated };
template <Weight W>
struct WeightTag {
  static constexpr Weight value = W;
};

// Calls fn(WeightTag<...>{}) for the state's weight layout (host code).
template <typename Fn>
inline auto dispatch_weight(const fastffn_adamw_state& state, Fn&& fn) {
  if (state.master != nullptr) return fn(WeightTag<Weight::kMaster>{});
  if (state.compensation != nullptr) return fn(WeightTag<Weight::kCompensated>{});
  return fn(WeightTag<Weight::kParam>{});
}

// --- 8-bit blockwise moments (fastffn/optimizer.h says why this map and block) ------------------
constexpr int kQuantBlock = FASTFFN_ADAMW_QUANT_BLOCK;
constexpr int kMapSize = 256;

// Entry `code` of bitsandbytes' dynamic map (create_dynamic_map(signed, 7, 8)), ascending: the
// positive values are, per decade d = 0..6, the midpoints of `per_decade << d` equal steps of
// [0.1, 1] times 10^(d - 6) (per_decade 1 signed, 2 unsigned); the signed map mirrors them below
// 0.0 (code 127); the unsigned map starts at 0.0 (code 0); both end with 1.0 (code 255).
// Double math rounded once to fp32; the decade scales are literals so that every evaluation
// (and the tests' numpy one) sees the same doubles.
FASTFFN_HOST_DEVICE float dynamic_map_value(int code, bool is_signed) {
  const double kDecade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  if (code == kMapSize - 1) return 1.f;
  const int zero = is_signed ? 127 : 0;
  if (code == zero) return 0.f;
  const bool negative = code < zero;
  int j = negative ? zero - 1 - code : code - zero - 1;  // rank among the positive values
  int count = is_signed ? 1 : 2;
  int decade = 0;
  while (j >= count) {
    j -= count;
    count *= 2;
    ++decade;
  }
  const float v = static_cast<float>(kDecade[decade] * (0.1 + (j + 0.5) * 0.9 / count));
  return negative ? -v : v;
}

// The code whose map entry is nearest to x (ties: the lower code), by bisection of the ascending
// map; x outside the map's range takes its end.
FASTFFN_HOST_DEVICE int nearest_code(const float* map, float x) {
  if (x <= map[0]) return 0;
  if (x >= map[kMapSize - 1]) return kMapSize - 1;
  int lo = 0, hi = kMapSize - 1;  // map[lo] <= x < map[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (map[mid] <= x) lo = mid;
    else hi = mid;
  }
  return x - map[lo] <= map[hi] - x ? lo : hi;
}

// max that keeps NaN from either side (fmaxf drops it): a NaN moment poisons its block's absmax.
FASTFFN_HOST_DEVICE float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// m / absmax onto the map's [-1, 1] (0 for an all-zero or NaN block: its absmax says it all).
FASTFFN_HOST_DEVICE int quantize(const float* map, float m, float absmax) {
  return nearest_code(map, absmax > 0.f ? div_rn(m, absmax) : 0.f);
}

}  // namespace fastffn
