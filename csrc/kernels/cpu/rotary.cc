// Rotary position embedding on the CPU for q and k (grouped-query heads) in one pass over the
// tokens: out = x * cos[p] + rotate_half(x) * sin[p], or its transpose for the backward.
#include "cpu_common.h"
#include "../validate.h"

namespace fastffn {
namespace cpu {
namespace {

// Rotates `heads` contiguous heads of one token. Forward: for j < h,
//   out[j] = x[j] c[j] - x[j+h] s[j],   out[j+h] = x[j+h] c[j+h] + x[j] s[j+h].
// Inverse (transpose of the forward map):
//   out[j] = x[j] c[j] + x[j+h] s[j+h], out[j+h] = x[j+h] c[j+h] - x[j] s[j].
template <typename T>
void rotate_token(const T* in, T* out, int64_t heads, int64_t dim, const float* c, const float* s,
                  bool inverse) {
  const int64_t h = dim / 2;
  for (int64_t head = 0; head < heads; ++head) {
    const T* x = in + head * dim;
    T* o = out + head * dim;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      const auto lo = to_float(x[j]);
      const auto hi = to_float(x[j + h]);
      if (!inverse) {
        o[j] = store<T>(lo * c[j] - hi * s[j]);
        o[j + h] = store<T>(hi * c[j + h] + lo * s[j + h]);
      } else {
        o[j] = store<T>(lo * c[j] + hi * s[j + h]);
        o[j + h] = store<T>(hi * c[j + h] - lo * s[j]);
      }
    }
  }
}

template <typename T>
void rotary(const fastffn_rotary_args& a, const T* q, const T* k, const float* cos,
            const float* sin, const int64_t* position_ids, T* q_out, T* k_out) {
  const int64_t tokens = a.batch * a.seq;
  const int64_t d = a.head_dim;
  const int64_t q_out_stride = a.q_out_token_stride ? a.q_out_token_stride : a.q_heads * d;
  const int64_t k_out_stride = a.k_out_token_stride ? a.k_out_token_stride : a.k_heads * d;
  const int64_t elements = tokens * (a.q_heads + a.k_heads) * d;
#pragma omp parallel for schedule(static) num_threads(parallel_threads(elements))
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = position_ids ? position_ids[t] : t % a.seq;
    const float* c = cos + p * d;
    const float* s = sin + p * d;
    rotate_token(q + t * a.q_token_stride, q_out + t * q_out_stride, a.q_heads, d, c, s,
                 a.inverse != 0);
    rotate_token(k + t * a.k_token_stride, k_out + t * k_out_stride, a.k_heads, d, c, s,
                 a.inverse != 0);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace fastffn

using namespace fastffn::cpu;

extern "C" fastffn_status fastffn_rotary_cpu(fastffn_rotary_args args, const void* q, const void* k,
                                             const float* cos, const float* sin,
                                             const int64_t* position_ids, void* q_out,
                                             void* k_out) {
  FASTFFN_TRY_STATUS(
      fastffn::check_rotary(__func__, args, q, k, cos, sin, q_out, k_out, position_ids, true));
  const int64_t tokens = args.batch * args.seq;
  if (position_ids != nullptr) {
    for (int64_t t = 0; t < tokens; ++t)
      FASTFFN_CHECK_ARG(position_ids[t] >= 0 && position_ids[t] < args.table_rows, __func__,
                        "position_ids[%lld] is %lld, outside the cos/sin table [0, %lld)",
                        (long long)t, (long long)position_ids[t], (long long)args.table_rows);
  }
  return dispatch_dtype(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    rotary<T>(args, static_cast<const T*>(q), static_cast<const T*>(k), cos, sin, position_ids,
              static_cast<T*>(q_out), static_cast<T*>(k_out));
  });
}
