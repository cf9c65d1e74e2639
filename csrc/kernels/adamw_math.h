// The AdamW update of fastffn/optimizer.h, written once for the CPU (g++) and CUDA (nvcc) kernels
// so that both run the same operations in the same order: Paddle's CUDA adamw kernel
// (AdamWKernelREG), fp32 throughout.
#pragma once

#include <cmath>

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

}  // namespace fastffn
