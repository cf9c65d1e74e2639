// AdamW on the CPU (fastffn/optimizer.h): one pass over the tensor, chunks split across OpenMP
// threads, the inner loop vectorised (the update has no branch; sqrt and division vectorise).
// 8-bit moments: one quantisation block per work item, dequantised, updated and requantised while
// it sits in the cache.
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
#include <cmath>

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

// An element's fp32 weight and where it goes back (fastffn_adamw_state's three layouts).
template <typename T, Weight W>
struct Weights {
  T* param;
  float* master;
  T* compensation;

  float load(int64_t i) const {
    if constexpr (W == Weight::kMaster) return master[i];
    if constexpr (W == Weight::kCompensated) return to_float(param[i]) + to_float(compensation[i]);
    return to_float(param[i]);
  }

  // Returns the bits of |param[i]| as stored (fastffn_adamw_state.param_amax).
  uint32_t store(int64_t i, float p) const {
    const T rounded = ::fastffn::cpu::store<T>(p);
    param[i] = rounded;
    if constexpr (W == Weight::kMaster) master[i] = p;
    if constexpr (W == Weight::kCompensated)
      compensation[i] = ::fastffn::cpu::store<T>(p - to_float(rounded));
    return float_bits(to_float(rounded)) & 0x7FFFFFFFu;
  }
};

// The largest of the chunks' amax bits into *param_amax (NULL: not asked for).
inline void write_amax(float* param_amax, uint32_t bits) {
  if (param_amax != nullptr) *param_amax = bits_float(bits);
}

template <typename T, typename G, Weight W>
void adamw_dense(const AdamwStep& s, int64_t n, const Weights<T, W>& w, const G* grad,
                 float* moment1, float* moment2, float* param_amax) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  uint32_t amax = 0;
#pragma omp parallel for schedule(static) num_threads(parallel_threads(n)) reduction(max : amax)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
#pragma omp simd reduction(max : amax)
    for (int64_t i = c * kChunk; i < end; ++i) {
      float p = w.load(i);
      float m1 = moment1[i], m2 = moment2[i];
      adamw_update(s, p, to_float(grad[i]), m1, m2);
      moment1[i] = m1;
      moment2[i] = m2;
      amax = std::max(amax, w.store(i, p));
    }
  }
  write_amax(param_amax, amax);
}

// The dynamic maps and their search tables, evaluated once (thread-safe static initialisation).
const DynamicMapTables& dynamic_maps() {
  static const DynamicMapTables tables = [] {
    DynamicMapTables t;
    for (int i = 0; i < 2 * kMapSize; ++i) fill_map_entry(t, i);
    for (int i = 0; i < 2 * kGuessSize; ++i) fill_guess_entry(t, i);
    return t;
  }();
  return tables;
}

// One quantisation block per work item: dequantise, update, new absmax, requantise.
template <typename T, typename G, Weight W>
void adamw_blockwise(const AdamwStep& s, int64_t n, const Weights<T, W>& w, const G* grad,
                     uint8_t* codes1, uint8_t* codes2, float* absmax1, float* absmax2,
                     float* param_amax) {
  const DynamicMapTables& maps = dynamic_maps();
  const float* map1 = maps.map[0];
  const float* map2 = maps.map[1];
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  uint32_t amax = 0;
#pragma omp parallel for schedule(static) num_threads(parallel_threads(n)) reduction(max : amax)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kQuantBlock;
    const int count = static_cast<int>(std::min<int64_t>(kQuantBlock, n - first));
    float m1[kQuantBlock], m2[kQuantBlock];
    float new_absmax1 = 0.f, new_absmax2 = 0.f;
    for (int k = 0; k < count; ++k) {
      const int64_t i = first + k;
      float p = w.load(i);
      m1[k] = map1[codes1[i]] * absmax1[b];
      m2[k] = map2[codes2[i]] * absmax2[b];
      adamw_update(s, p, to_float(grad[i]), m1[k], m2[k]);
      amax = std::max(amax, w.store(i, p));
      new_absmax1 = nan_max(new_absmax1, std::fabs(m1[k]));
      new_absmax2 = nan_max(new_absmax2, std::fabs(m2[k]));
    }
    absmax1[b] = new_absmax1;
    absmax2[b] = new_absmax2;
    for (int k = 0; k < count; ++k) {
      codes1[first + k] = static_cast<uint8_t>(quantize(maps, true, m1[k], new_absmax1));
      codes2[first + k] = static_cast<uint8_t>(quantize(maps, false, m2[k], new_absmax2));
    }
  }
  write_amax(param_amax, amax);
}

template <typename T, typename G>
void adamw_with_state(const AdamwStep& s, int64_t n, void* param, const void* grad,
                      const fastffn_adamw_state& state) {
  dispatch_weight(state, [&](auto tag) {
    constexpr Weight W = decltype(tag)::value;
    const Weights<T, W> w{static_cast<T*>(param), state.master, static_cast<T*>(state.compensation)};
    const G* g = static_cast<const G*>(grad);
    if (state.moments == FASTFFN_MOMENTS_BLOCKWISE_8BIT)
      adamw_blockwise(s, n, w, g, static_cast<uint8_t*>(state.moment1),
                      static_cast<uint8_t*>(state.moment2), state.absmax1, state.absmax2, state.param_amax);
    else
      adamw_dense(s, n, w, g, static_cast<float*>(state.moment1), static_cast<float*>(state.moment2),
                  state.param_amax);
  });
}

}  // namespace
}  // namespace cpu
}  // namespace fastffn

using namespace fastffn::cpu;

extern "C" fastffn_status fastffn_adamw_with_state_cpu(fastffn_adamw_args args, void* param,
                                                       const void* grad, fastffn_adamw_state state) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw_state(__func__, args, param, grad, state));
  if (args.n == 0) {
    write_amax(state.param_amax, 0);
    return FASTFFN_STATUS_OK;
  }
  const fastffn::AdamwStep step = fastffn::adamw_step(
      args, read(args.lr), read(args.beta1_pow), read(args.beta2_pow), read(args.grad_scale));
  auto run = [&](auto param_tag, auto grad_tag) {
    adamw_with_state<decltype(param_tag), decltype(grad_tag)>(step, args.n, param, grad, state);
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

extern "C" fastffn_status fastffn_adamw_cpu(fastffn_adamw_args args, void* param,
                                            const void* grad, float* master, float* moment1,
                                            float* moment2) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw(__func__, args, param, grad, moment1, moment2));
  const fastffn_adamw_state state{FASTFFN_MOMENTS_FLOAT32, moment1, moment2, nullptr, nullptr,
                                  master, nullptr, nullptr};
  return fastffn_adamw_with_state_cpu(args, param, grad, state);
}

extern "C" fastffn_status fastffn_adamw_update_pows_cpu(float beta1, float beta2,
                                                        float* beta1_pow, float* beta2_pow) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw_pows(__func__, beta1_pow, beta2_pow));
  *beta1_pow = beta1 * *beta1_pow;
  *beta2_pow = beta2 * *beta2_pow;
  return FASTFFN_STATUS_OK;
}
