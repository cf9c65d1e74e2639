// AdamW on the CPU (fastffn/optimizer.h): one pass over the tensor, chunks split across OpenMP
// threads, the inner loop vectorised (the update has no branch; sqrt and division vectorise).
//
// No floating-point contraction in this file: with -mfma g++ fused m1 = beta1*m1 + (1-beta1)*g
// (and its neighbours) into FMAs, one rounding where Paddle's CPU AdamW rounds after the multiply
// and again after the add, and moment1 then differed from stock beyond the tests' relative
// tolerance for elements near zero (11 tests/optim comparisons against paddle.optimizer.AdamW on
// an AVX2/FMA host). The pragma covers adamw_math.h's inline functions, included below it.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <algorithm>

#include "cpu_common.h"
#include "../adamw_math.h"
#include "../validate.h"

namespace fastffn {
namespace cpu {
namespace {

// Elements per OpenMP work item: large enough that a thread streams, small enough that a 2-core
// machine splits a 4097-element tensor.
constexpr int64_t kChunk = 2048;

inline float read(fastffn_scalar s) { return s.ptr != nullptr ? *s.ptr : s.value; }

template <typename T, typename G, bool kMaster>
void adamw(const AdamwStep& s, int64_t n, T* param, const G* grad, float* master, float* moment1,
           float* moment2) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(parallel_threads(n))
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
#pragma omp simd
    for (int64_t i = c * kChunk; i < end; ++i) {
      float p = kMaster ? master[i] : to_float(param[i]);
      float m1 = moment1[i], m2 = moment2[i];
      adamw_update(s, p, to_float(grad[i]), m1, m2);
      moment1[i] = m1;
      moment2[i] = m2;
      if constexpr (kMaster) master[i] = p;
      param[i] = store<T>(p);
    }
  }
}

}  // namespace
}  // namespace cpu
}  // namespace fastffn

using namespace fastffn::cpu;

extern "C" fastffn_status fastffn_adamw_cpu(fastffn_adamw_args args, void* param,
                                            const void* grad, float* master, float* moment1,
                                            float* moment2) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw(__func__, args, param, grad, moment1, moment2));
  if (args.n == 0) return FASTFFN_STATUS_OK;
  const fastffn::AdamwStep step = fastffn::adamw_step(
      args, read(args.lr), read(args.beta1_pow), read(args.beta2_pow), read(args.grad_scale));
  auto run = [&](auto param_tag, auto grad_tag) {
    using T = decltype(param_tag);
    using G = decltype(grad_tag);
    auto kernel = master != nullptr ? adamw<T, G, true> : adamw<T, G, false>;
    kernel(step, args.n, static_cast<T*>(param), static_cast<const G*>(grad), master, moment1,
           moment2);
    return FASTFFN_STATUS_OK;
  };
  const bool fp32_grad = args.grad_dtype == FASTFFN_DTYPE_FLOAT32;
  switch (args.param_dtype) {  // check_adamw admitted these three
    case FASTFFN_DTYPE_FLOAT16:
      return fp32_grad ? run(float16_storage{}, float{}) : run(float16_storage{}, float16_storage{});
    case FASTFFN_DTYPE_BFLOAT16:
      return fp32_grad ? run(bfloat16_storage{}, float{}) : run(bfloat16_storage{}, bfloat16_storage{});
    default:
      return run(float{}, float{});
  }
}

extern "C" fastffn_status fastffn_adamw_update_pows_cpu(float beta1, float beta2,
                                                        float* beta1_pow, float* beta2_pow) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw_pows(__func__, beta1_pow, beta2_pow));
  *beta1_pow = beta1 * *beta1_pow;
  *beta2_pow = beta2 * *beta2_pow;
  return FASTFFN_STATUS_OK;
}
