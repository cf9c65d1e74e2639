// Rotary position embedding on the CPU for q and k (grouped-query heads) in one pass over the
// tokens: out = x * cos[p] + rotate_half(x) * sin[p], or its transpose for the backward; v (when
// given) is copied in the same pass. Heads are addressed through fastffn_heads_layout (c_api.h),
// so q, k and v can be read from or written into PaddleNLP's interleaved fused qkv.
#include <cstring>
#include <limits>

#include "cpu_common.h"
#include "../validate.h"

namespace fastffn {
namespace cpu {
namespace {

inline int64_t head_offset(const fastffn_heads_layout& l, int64_t token, int64_t head) {
  return token * l.token_stride + (head / l.heads_per_group) * l.group_stride +
         (head % l.heads_per_group) * l.head_stride;
}

// Rotates one head. Forward: for j < h,
//   out[j] = x[j] c[j] - x[j+h] s[j],   out[j+h] = x[j+h] c[j+h] + x[j] s[j+h].
// Inverse (transpose of the forward map):
//   out[j] = x[j] c[j] + x[j+h] s[j+h], out[j+h] = x[j+h] c[j+h] - x[j] s[j].
template <typename T>
void rotate_head(const T* x, T* o, int64_t dim, const float* c, const float* s, bool inverse) {
  const int64_t h = dim / 2;
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

template <typename T>
void nan_heads(T* base, const fastffn_heads_layout& l, int64_t token, int64_t heads, int64_t dim) {
  for (int64_t head = 0; head < heads; ++head) {
    T* o = base + head_offset(l, token, head);
    for (int64_t j = 0; j < dim; ++j) o[j] = store<T>(std::numeric_limits<float>::quiet_NaN());
  }
}

template <typename T>
void rotary(const fastffn_rotary_args& a, const T* q, const T* k, const T* v, const float* cos,
            const float* sin, const int64_t* position_ids, T* q_out, T* k_out, T* v_out) {
  const int64_t tokens = a.batch * a.seq;
  const int64_t d = a.head_dim;
  const int64_t elements = tokens * (a.q_heads + a.k_heads * (v ? 2 : 1)) * d;
  const bool inverse = a.inverse != 0;
#pragma omp parallel for schedule(static) num_threads(parallel_threads(elements))
  for (int64_t t = 0; t < tokens; ++t) {
    if (v != nullptr) {
      for (int64_t head = 0; head < a.k_heads; ++head)
        std::memcpy(v_out + head_offset(a.v_out, t, head), v + head_offset(a.v_in, t, head),
                    sizeof(T) * d);
    }
    const int64_t p = position_ids ? position_ids[t] : t % a.seq;
    if (p < 0 || p >= a.table_rows) {  // only reached with position_error set: flag and poison
#pragma omp atomic write
      *a.position_error = 1;
      nan_heads(q_out, a.q_out, t, a.q_heads, d);
      nan_heads(k_out, a.k_out, t, a.k_heads, d);
      continue;
    }
    const float* c = cos + p * d;
    const float* s = sin + p * d;
    for (int64_t head = 0; head < a.q_heads; ++head)
      rotate_head(q + head_offset(a.q_in, t, head), q_out + head_offset(a.q_out, t, head), d, c, s,
                  inverse);
    for (int64_t head = 0; head < a.k_heads; ++head)
      rotate_head(k + head_offset(a.k_in, t, head), k_out + head_offset(a.k_out, t, head), d, c, s,
                  inverse);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace fastffn

using namespace fastffn::cpu;

extern "C" fastffn_status fastffn_rotary_cpu(fastffn_rotary_args args, const void* q, const void* k,
                                             const void* v, const float* cos, const float* sin,
                                             const int64_t* position_ids, void* q_out, void* k_out,
                                             void* v_out) {
  FASTFFN_TRY_STATUS(fastffn::check_rotary(__func__, args, q, k, v, cos, sin, q_out, k_out, v_out,
                                           position_ids, true));
  const int64_t tokens = args.batch * args.seq;
  if (position_ids != nullptr && args.position_error == nullptr) {
    for (int64_t t = 0; t < tokens; ++t)
      FASTFFN_CHECK_ARG(position_ids[t] >= 0 && position_ids[t] < args.table_rows, __func__,
                        "position_ids[%lld] is %lld, outside the cos/sin table [0, %lld)",
                        (long long)t, (long long)position_ids[t], (long long)args.table_rows);
  }
  return dispatch_dtype(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    rotary<T>(args, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
              cos, sin, position_ids, static_cast<T*>(q_out), static_cast<T*>(k_out),
              static_cast<T*>(v_out));
  });
}
