// Shared pieces of the CPU kernels: half-precision storage types, fp32 conversion, dtype
// dispatch and a vectorisable expf. Framework-neutral: no Paddle header.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include <omp.h>

#include "fastffn/c_api.h"
#include "../validate.h"

namespace fastffn {
namespace cpu {

// How many OpenMP threads a kernel over `elements` elements of work uses: one below
// kMinElementsPerThread, then one more per kMinElementsPerThread up to the runtime's count (Paddle's:
// the library links Paddle's OpenMP runtime, build_definition.paddle_openmp_link_flags). A parallel
// region wakes every worker of the pool, and the demo-size model's per-layer kernels at SFT batch
// shapes are tens of microseconds of work, less than the fork/join and the wake-up they would cost
// Paddle's pool. Measured (benchmarks/results/cpu_parallel_threshold.json at commit 8c5140e, 2-core
// dev machine, shared, load 6): SwiGLU fwd+bwd at 180k elements took 0.90 ms on 2 threads vs 0.75
// ms on one, RMSNorm fwd+bwd 0.54 vs 0.36 ms at 65k; 2 threads first broke even on SwiGLU near 720k
// elements. 2^17 elements per thread is ~0.4 ms of SwiGLU work, far above a fork/join, so big kernels (7B widths,
// many cores) still split.
constexpr int64_t kMinElementsPerThread = int64_t{1} << 17;

inline int parallel_threads(int64_t elements) {
  const int64_t by_size = elements / kMinElementsPerThread;
  const int64_t most = omp_get_max_threads();
  return static_cast<int>(by_size < 1 ? 1 : (by_size < most ? by_size : most));
}

struct bfloat16_storage {
  uint16_t bits;
};
using float16_storage = _Float16;  // GCC >= 12 and clang support _Float16 on x86-64 and arm64.

inline float to_float(float v) { return v; }
inline double to_float(double v) { return v; }  // float64 computes in double (gradient checks)
inline float to_float(float16_storage v) { return static_cast<float>(v); }
inline float to_float(bfloat16_storage v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline float16_storage from_float<float16_storage>(float v) { return static_cast<float16_storage>(v); }
template <>
inline bfloat16_storage from_float<bfloat16_storage>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16_storage{0x7fc0};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                       // round to nearest even
  return bfloat16_storage{static_cast<uint16_t>(u >> 16)};
}


// The type math is done in: fp32 for every storage dtype but float64, which exists for gradient
// checks of the surrounding code and so computes in double.
template <typename T>
struct compute_type { using type = float; };
template <>
struct compute_type<double> { using type = double; };
template <typename T>
using compute_t = typename compute_type<T>::type;

template <typename T>
inline T store(compute_t<T> v) { return from_float<T>(v); }
template <>
inline double store<double>(double v) { return v; }

// Rounds to the storage dtype and back: what a framework op produces when it writes an
// intermediate tensor in that dtype (used where PaddleNLP's numerics round mid-way).
template <typename T>
inline compute_t<T> round_to_storage(compute_t<T> v) { return to_float(store<T>(v)); }

// Calls fn(T{}) with T the storage type of `dtype`; float64 computes in fp64-stored, fp32-math
// form as well (it exists for gradient checks of the surrounding Python code, not for speed).
template <typename Fn>
inline fastffn_status dispatch_dtype(fastffn_dtype dtype, Fn&& fn) {
  switch (dtype) {
    case FASTFFN_DTYPE_FLOAT32: fn(float{}); return FASTFFN_STATUS_OK;
    case FASTFFN_DTYPE_FLOAT64: fn(double{}); return FASTFFN_STATUS_OK;
    case FASTFFN_DTYPE_FLOAT16: fn(float16_storage{}); return FASTFFN_STATUS_OK;
    case FASTFFN_DTYPE_BFLOAT16: fn(bfloat16_storage{}); return FASTFFN_STATUS_OK;
    default:  // the entry points check the dtype first; this is the last line of defence
      return fail(FASTFFN_STATUS_UNSUPPORTED_DTYPE, "fastffn CPU dtype dispatch",
                  "%s is not a storage dtype of the CPU kernels", dtype_name(dtype));
  }
}

inline float bit_cast_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// expf from the Cephes polynomial (max error ~1 ulp on the clamped range), written without
// branches or errno so that `#pragma omp simd` loops vectorise; glibc's expf does not vectorise
// without -ffast-math, which we avoid because it also drops NaN semantics.
#pragma omp declare simd notinbranch
inline float fast_expf(float x) {
  // Ternaries rather than std::fmin/std::floor, which need SSE4.1 or NaN-exact semantics; with
  // -fno-trapping-math (set by the build) GCC 12 if-converts these into vector blends.
  float clamped = x < -87.33654f ? -87.33654f : x;
  clamped = clamped > 88.72283f ? 88.72283f : clamped;
  const float y = clamped * 1.44269504088896341f + 0.5f;
  int32_t ni = static_cast<int32_t>(y);           // truncation, then floor for negative y
  ni -= (y < static_cast<float>(ni)) ? 1 : 0;
  const float n = static_cast<float>(ni);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  // Scale by 2^n in two steps so that n = 128 (x near 88.7) does not overflow the exponent field.
  const int32_t half = ni >> 1;
  const float s1 = bit_cast_float(static_cast<uint32_t>(half + 127) << 23);
  const float s2 = bit_cast_float(static_cast<uint32_t>(ni - half + 127) << 23);
  // NaN in, NaN out without a select: NaN survives the clamps and the polynomial.
  return p * s1 * s2;
}

#pragma omp declare simd notinbranch
inline float sigmoid(float x) { return 1.0f / (1.0f + fast_expf(-x)); }
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace cpu
}  // namespace fastffn
