// The AdamW update of fastffn/optimizer.h, written once for the CPU (g++) and CUDA (nvcc) kernels
// so that both run the same operations in the same order: Paddle's CUDA adamw kernel
// (AdamWKernelREG), fp32 throughout.
#pragma once

#include <cmath>
#include <cstring>
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

// The nearest-code search. A table per map, indexed by the top bits of |x| (its exponent and 7
// mantissa bits, buckets narrower than the map's spacing from 2^-22, below its smallest positive
// entry, up to 1.0), holds how many positive entries lie below the bucket; from the code it names a
// walk of a step or two reaches the entries around x, so that a search reads ~3 map entries where a
// bisection reads 10 (on the GPU each read is a shared-memory load whose lanes scatter over the banks).
constexpr int kGuessShift = 16;                               // float bits dropped
constexpr int kGuessFirst = 0x3480;                           // 2^-22 >> kGuessShift
constexpr int kGuessSize = (0x3F80 /* 1.0 */ - kGuessFirst);  // buckets in [2^-22, 1)

FASTFFN_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

FASTFFN_HOST_DEVICE float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

FASTFFN_HOST_DEVICE int zero_code(bool is_signed) { return is_signed ? 127 : 0; }

// Both maps and their bucket tables; index 0 is the signed map (m1), 1 the unsigned one (m2).
struct DynamicMapTables {
  float map[2][kMapSize];
  uint8_t guess[2][kGuessSize];
};

// Entry i of `map` (i < 2 * kMapSize), by the formula.
FASTFFN_HOST_DEVICE void fill_map_entry(DynamicMapTables& t, int i) {
  const int which = i / kMapSize;
  t.map[which][i % kMapSize] = dynamic_map_value(i % kMapSize, which == 0);
}

// Entry i of `guess` (i < 2 * kGuessSize) from the finished maps: the number of positive entries
// (codes zero + 1 .. 254) below the bucket's lowest value, by a bisection of fixed length (no
// data-dependent branch, so a thread filling several entries overlaps their reads).
FASTFFN_HOST_DEVICE void fill_guess_entry(DynamicMapTables& t, int i) {
  const int which = i / kGuessSize;
  const float* map = t.map[which];
  const float lowest = bits_float(static_cast<uint32_t>(kGuessFirst + i % kGuessSize) << kGuessShift);
  const int first = zero_code(which == 0) + 1;
  int below = 0;  // entries of [first, first + below) are < lowest; map[255] = 1 is not
  for (int step = kMapSize / 2; step > 0; step /= 2) {
    const int probe = first + below + step - 1;
    if (probe < kMapSize - 1 && map[probe] < lowest) below += step;
  }
  t.guess[which][i % kGuessSize] = static_cast<uint8_t>(below);
}

// The code whose map entry is nearest to x (ties: the lower code); x outside the map's range takes
// its end. Inside it, lo with map[lo] <= x < map[lo + 1] is unique (the map ascends strictly): the
// walk finds it from any start in [0, 254] and never leaves that range, since map[0] < x < map[255];
// the guess only shortens the walk. NaN (inf / inf: an infinite moment in an infinite block) takes
// code 1, where a bisection whose comparisons are all false ends.
FASTFFN_HOST_DEVICE int nearest_code(const float* map, const uint8_t* guess, bool is_signed, float x) {
  if (x <= map[0]) return 0;
  if (x >= map[kMapSize - 1]) return kMapSize - 1;
  if (x != x) return 1;
  const int bucket = static_cast<int>((float_bits(x) & 0x7FFFFFFFu) >> kGuessShift) - kGuessFirst;  // |x|
  const int below = guess[bucket < 0 ? 0 : (bucket < kGuessSize ? bucket : kGuessSize - 1)];
  int lo = x < 0.f ? zero_code(is_signed) - 1 - below : zero_code(is_signed) + below;
  lo = lo < 0 ? 0 : (lo < kMapSize - 2 ? lo : kMapSize - 2);
  float low = map[lo], high = map[lo + 1];
  while (low > x) {
    high = low;
    low = map[--lo];
  }
  while (high <= x) {
    low = high;
    high = map[++lo + 1];
  }
  return x - low <= high - x ? lo : lo + 1;
}

// max that keeps NaN from either side (fmaxf drops it): a NaN moment poisons its block's absmax.
FASTFFN_HOST_DEVICE float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// m / absmax onto the map's [-1, 1] (0 for an all-zero or NaN block: its absmax says it all).
FASTFFN_HOST_DEVICE int quantize(const DynamicMapTables& t, bool is_signed, float m, float absmax) {
  const int which = is_signed ? 0 : 1;
  return nearest_code(t.map[which], t.guess[which], is_signed, absmax > 0.f ? div_rn(m, absmax) : 0.f);
}

}  // namespace fastffn
