// Rotary position embedding on CUDA for q and k (grouped-query heads) in one launch: one block
// per token, threads over (head, vector of the first half of head_dim); each thread rotates the
// pair (x[j], x[j + h]) so every element is read and written once. fp32 cos/sin tables.
#include "cuda_common.cuh"
#include "../validate.h"

namespace fastffn {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxTokenBlocks = int64_t(1) << 30;

// An out-of-range position has no rotation: its outputs become NaN, never a silent clamp.
template <typename T>
__device__ void write_nan_token(T* out, int width) {
  for (int i = threadIdx.x; i < width; i += blockDim.x) out[i] = from_float<T>(__int_as_float(0x7fc00000));
}

template <typename T, int V, bool kInverse>
__global__ void __launch_bounds__(kThreads)
rotary_kernel(const T* __restrict__ q, const T* __restrict__ k, const float* __restrict__ cos,
              const float* __restrict__ sin, const int64_t* __restrict__ position_ids,
              T* __restrict__ q_out, T* __restrict__ k_out, int64_t tokens, int seq, int q_heads,
              int k_heads, int head_dim, int64_t q_token_stride, int64_t k_token_stride,
              int64_t q_out_token_stride, int64_t k_out_token_stride, int64_t table_rows,
              int32_t* __restrict__ position_error) {
  const int half = head_dim / 2;
  const int vecs_per_half = half / V;
  const int work = (q_heads + k_heads) * vecs_per_half;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t p = position_ids ? position_ids[t] : t % seq;
    if (p < 0 || p >= table_rows) {  // never read out of bounds; report and poison the token
      if (threadIdx.x == 0 && position_error != nullptr) *position_error = 1;
      write_nan_token(q_out + t * q_out_token_stride, q_heads * head_dim);
      write_nan_token(k_out + t * k_out_token_stride, k_heads * head_dim);
      continue;
    }
    const float* c = cos + p * head_dim;
    const float* s = sin + p * head_dim;
    // Unrolled so that each thread issues the loads of several (head, vector) items before it
    // stores: one item per iteration left the memory system idle between dependent steps.
#pragma unroll 4
    for (int w = threadIdx.x; w < work; w += blockDim.x) {
      const int head = w / vecs_per_half;
      const int j = (w - head * vecs_per_half) * V;
      const bool is_q = head < q_heads;
      const T* src = is_q ? q + t * q_token_stride + static_cast<int64_t>(head) * head_dim
                          : k + t * k_token_stride + static_cast<int64_t>(head - q_heads) * head_dim;
      T* dst = is_q ? q_out + t * q_out_token_stride + static_cast<int64_t>(head) * head_dim
                    : k_out + t * k_out_token_stride + static_cast<int64_t>(head - q_heads) * head_dim;
      const Vec<T, V> lo = load_vec<V>(src + j);
      const Vec<T, V> hi = load_vec<V>(src + half + j);
      float c_lo[V], c_hi[V], s_lo[V], s_hi[V];
      load_floats<V>(c + j, c_lo);
      load_floats<V>(c + half + j, c_hi);
      load_floats<V>(s + j, s_lo);
      load_floats<V>(s + half + j, s_hi);
      Vec<T, V> out_lo, out_hi;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float a = to_float(lo.v[i]);
        const float b = to_float(hi.v[i]);
        if constexpr (!kInverse) {  // [a, b] -> [a c - b s, b c + a s]
          out_lo.v[i] = from_float<T>(a * c_lo[i] - b * s_lo[i]);
          out_hi.v[i] = from_float<T>(b * c_hi[i] + a * s_hi[i]);
        } else {  // transpose: [a, b] -> [a c + b s_hi, b c - a s_lo]
          out_lo.v[i] = from_float<T>(a * c_lo[i] + b * s_hi[i]);
          out_hi.v[i] = from_float<T>(b * c_hi[i] - a * s_lo[i]);
        }
      }
      store_vec<V>(dst + j, out_lo);
      store_vec<V>(dst + half + j, out_hi);
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;

extern "C" fastffn_status fastffn_rotary_cuda(fastffn_rotary_args a, const void* q, const void* k,
                                              const float* cos, const float* sin,
                                              const int64_t* position_ids, void* q_out,
                                              void* k_out, void* stream) {
  FASTFFN_TRY_STATUS(
      fastffn::check_rotary(__func__, a, q, k, cos, sin, q_out, k_out, position_ids, false));
  const int64_t tokens = a.batch * a.seq;
  if (tokens == 0) return FASTFFN_STATUS_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t q_out_stride = a.q_out_token_stride ? a.q_out_token_stride : a.q_heads * a.head_dim;
  const int64_t k_out_stride = a.k_out_token_stride ? a.k_out_token_stride : a.k_heads * a.head_dim;
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = kVecWidth<T>;
    const int half = static_cast<int>(a.head_dim / 2);
    // Vector path: half a head is whole vectors and every token/head start is 16-byte aligned.
    const bool vec = half % W == 0 && aligned16(q) && aligned16(k) && aligned16(q_out) &&
                     aligned16(k_out) && aligned16(cos) && aligned16(sin) &&
                     stride_aligned16<T>(a.q_token_stride) && stride_aligned16<T>(a.k_token_stride) &&
                     stride_aligned16<T>(q_out_stride) && stride_aligned16<T>(k_out_stride) &&
                     stride_aligned16<T>(a.head_dim) && a.head_dim % 4 == 0;
    const unsigned int grid = static_cast<unsigned int>(tokens < kMaxTokenBlocks ? tokens : kMaxTokenBlocks);
    return FASTFFN_BOOL_SWITCH(vec, kVector, [&] {
      return FASTFFN_BOOL_SWITCH(a.inverse != 0, kInverse, [&] {
        constexpr int V = kVector ? W : 1;
        rotary_kernel<T, V, kInverse><<<grid, kThreads, 0, s>>>(
            static_cast<const T*>(q), static_cast<const T*>(k), cos, sin, position_ids,
            static_cast<T*>(q_out), static_cast<T*>(k_out), tokens, static_cast<int>(a.seq),
            static_cast<int>(a.q_heads), static_cast<int>(a.k_heads), static_cast<int>(a.head_dim),
            a.q_token_stride, a.k_token_stride, q_out_stride, k_out_stride, a.table_rows,
            a.position_error);
        return launch_status();
      });
    });
  });
}
