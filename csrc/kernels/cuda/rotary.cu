// Rotary position embedding on CUDA for q and k (grouped-query heads) in one launch, v (when
// given) copied in the same launch: one block per token, threads over (head, vector of the first
// half of head_dim); each thread rotates (or copies) the pair (x[j], x[j + h]) so every element
// is read and written once. Heads are addressed through fastffn_heads_layout (c_api.h), so q, k
// and v are read from, or written into, PaddleNLP's interleaved fused qkv directly. fp32 cos/sin.
#include "cuda_common.cuh"
#include "../validate.h"

namespace fastffn {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxTokenBlocks = int64_t(1) << 30;

__device__ __forceinline__ int64_t head_offset(const fastffn_heads_layout& l, int64_t token,
                                               int head) {
  const int group = head / static_cast<int>(l.heads_per_group);
  const int in_group = head - group * static_cast<int>(l.heads_per_group);
  return token * l.token_stride + group * l.group_stride + in_group * l.head_stride;
}

template <typename T>
struct RotaryTensors {
  const T* q;
  const T* k;
  const T* v;  // nullptr: no v
  T* q_out;
  T* k_out;
  T* v_out;
};

// An out-of-range position has no rotation: its outputs become NaN, never a silent clamp.
template <typename T>
__device__ void write_nan_heads(T* base, const fastffn_heads_layout& l, int64_t token, int heads,
                                int head_dim) {
  for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x)
    base[head_offset(l, token, i / head_dim) + i % head_dim] = from_float<T>(__int_as_float(0x7fc00000));
}

template <typename T, int V, bool kInverse>
__global__ void __launch_bounds__(kThreads)
rotary_kernel(RotaryTensors<T> x, const float* __restrict__ cos, const float* __restrict__ sin,
              const int64_t* __restrict__ position_ids, fastffn_rotary_args a, int64_t tokens) {
  const int head_dim = static_cast<int>(a.head_dim);
  const int q_heads = static_cast<int>(a.q_heads);
  const int k_heads = static_cast<int>(a.k_heads);
  const int half = head_dim / 2;
  const int vecs_per_half = half / V;
  const int rotated_heads = q_heads + k_heads;
  const int work = (rotated_heads + (x.v != nullptr ? k_heads : 0)) * vecs_per_half;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t p = position_ids ? position_ids[t] : t % a.seq;
    const bool in_table = p >= 0 && p < a.table_rows;
    if (!in_table) {  // never read out of bounds; report and poison the token
      if (threadIdx.x == 0 && a.position_error != nullptr) *a.position_error = 1;
      write_nan_heads(x.q_out, a.q_out, t, q_heads, head_dim);
      write_nan_heads(x.k_out, a.k_out, t, k_heads, head_dim);
    }
    const float* c = cos + (in_table ? p : 0) * head_dim;
    const float* s = sin + (in_table ? p : 0) * head_dim;
    // Unrolled so that each thread issues the loads of several (head, vector) items before it
    // stores: one item per iteration left the memory system idle between dependent steps.
#pragma unroll 4
    for (int w = threadIdx.x; w < work; w += blockDim.x) {
      const int head = w / vecs_per_half;
      const int j = (w - head * vecs_per_half) * V;
      if (head >= rotated_heads) {  // v: a copy, position-independent
        const int vh = head - rotated_heads;
        const T* src = x.v + head_offset(a.v_in, t, vh);
        T* dst = x.v_out + head_offset(a.v_out, t, vh);
        store_vec<V>(dst + j, load_vec<V>(src + j));
        store_vec<V>(dst + half + j, load_vec<V>(src + half + j));
        continue;
      }
      if (!in_table) continue;
      const bool is_q = head < q_heads;
      const T* src = is_q ? x.q + head_offset(a.q_in, t, head) : x.k + head_offset(a.k_in, t, head - q_heads);
      T* dst = is_q ? x.q_out + head_offset(a.q_out, t, head) : x.k_out + head_offset(a.k_out, t, head - q_heads);
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
        const float lo_f = to_float(lo.v[i]);
        const float hi_f = to_float(hi.v[i]);
        if constexpr (!kInverse) {  // [a, b] -> [a c - b s, b c + a s]
          out_lo.v[i] = from_float<T>(lo_f * c_lo[i] - hi_f * s_lo[i]);
          out_hi.v[i] = from_float<T>(hi_f * c_hi[i] + lo_f * s_hi[i]);
        } else {  // transpose: [a, b] -> [a c + b s_hi, b c - a s_lo]
          out_lo.v[i] = from_float<T>(lo_f * c_lo[i] + hi_f * s_hi[i]);
          out_hi.v[i] = from_float<T>(hi_f * c_hi[i] - lo_f * s_lo[i]);
        }
      }
      store_vec<V>(dst + j, out_lo);
      store_vec<V>(dst + half + j, out_hi);
    }
  }
}

template <typename T>
bool layout_aligned16(const fastffn_heads_layout& l) {
  return stride_aligned16<T>(l.token_stride) && stride_aligned16<T>(l.group_stride) &&
         stride_aligned16<T>(l.head_stride);
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;

extern "C" fastffn_status fastffn_rotary_cuda(fastffn_rotary_args a, const void* q, const void* k,
                                              const void* v, const float* cos, const float* sin,
                                              const int64_t* position_ids, void* q_out,
                                              void* k_out, void* v_out, void* stream) {
  FASTFFN_TRY_STATUS(fastffn::check_rotary(__func__, a, q, k, v, cos, sin, q_out, k_out, v_out,
                                           position_ids, false));
  const int64_t tokens = a.batch * a.seq;
  if (tokens == 0) return FASTFFN_STATUS_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = kVecWidth<T>;
    const int half = static_cast<int>(a.head_dim / 2);
    const bool with_v = v != nullptr;
    // Vector path: half a head is whole vectors and every head start is 16-byte aligned.
    const bool vec = half % W == 0 && aligned16(q) && aligned16(k) && aligned16(q_out) &&
                     aligned16(k_out) && aligned16(cos) && aligned16(sin) &&
                     layout_aligned16<T>(a.q_in) && layout_aligned16<T>(a.k_in) &&
                     layout_aligned16<T>(a.q_out) && layout_aligned16<T>(a.k_out) &&
                     (!with_v || (aligned16(v) && aligned16(v_out) && layout_aligned16<T>(a.v_in) &&
                                  layout_aligned16<T>(a.v_out))) &&
                     stride_aligned16<T>(a.head_dim) && a.head_dim % 4 == 0;
    const unsigned int grid = static_cast<unsigned int>(tokens < kMaxTokenBlocks ? tokens : kMaxTokenBlocks);
    const RotaryTensors<T> tensors{static_cast<const T*>(q), static_cast<const T*>(k),
                                   static_cast<const T*>(v), static_cast<T*>(q_out),
                                   static_cast<T*>(k_out), static_cast<T*>(v_out)};
    return FASTFFN_BOOL_SWITCH(vec, kVector, [&] {
      return FASTFFN_BOOL_SWITCH(a.inverse != 0, kInverse, [&] {
        constexpr int V = kVector ? W : 1;
        rotary_kernel<T, V, kInverse><<<grid, kThreads, 0, s>>>(tensors, cos, sin, position_ids, a,
                                                                tokens);
        return launch_status();
      });
    });
  });
}
