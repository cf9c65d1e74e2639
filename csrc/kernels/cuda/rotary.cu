// Rotary position embedding on CUDA for q and k (grouped-query heads) in one launch, v (when
// given) copied in the same launch: one block per token, threads over (head, vector of the first
// half of head_dim), or over (set of heads, vector) with FASTFFN_ROTARY_HEADS_PER_THREAD > 1; each
// thread rotates (or copies) the pair (x[j], x[j + h]) so every element is read and written once.
// Heads are addressed through fastffn_heads_layout (c_api.h), so q, k and v are read from, or
// written into, PaddleNLP's interleaved fused qkv directly. fp32 cos/sin.
#include "cuda_common.cuh"
#include "../validate.h"

namespace fastffn {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxTokenBlocks = int64_t(1) << 30;

// Heads per thread, a build-time knob for a tuning sweep (bench_gpu.py's rope_sweep section builds
// the harness's library with each value). 1, the default, is the kernel measured so far: one thread
// per (head, vector j) item, which loads the four fp32 cos/sin vectors of j (c_lo, c_hi, s_lo,
// s_hi: 128 bytes for a bf16 vector of 8) for 32 bytes of data, and every head of the token loads
// them again (from L1/L2, but ~4x the data's load instructions and L1 traffic). It was measured at
// 85-89% of the copy bandwidth (fwd, fwd+bwd) against Liger's 93-97% (H200,
// benchmarks/results/run15/gpu_bench.json),
// whose Triton program rotates all heads of a token with one load of its cos/sin row. Values > 1
// take rotary_kernel's kHeads > 1 loop: a thread owns one j and up to this many heads of the token
// (q, k and v's copy heads), loads j's cos/sin once and reuses it across them. The sweep (7B/13B/70B
// widths, fwd and fwd+bwd, Liger timed in the same run) decides whether a value > 1 becomes the
// default: more heads per thread means fewer loads but more registers (ptxas, bf16 vector path,
// sm_90a: 56-60 at 1, 96 at 2, 128 at 4, 214 at 8; none spill) and fewer threads per token. Its
// numbers go here when measured, as rms_norm.cu records its sweep.
#ifndef FASTFFN_ROTARY_HEADS_PER_THREAD
#define FASTFFN_ROTARY_HEADS_PER_THREAD 1
#endif
constexpr int kHeadsPerThread = FASTFFN_ROTARY_HEADS_PER_THREAD;
static_assert(kHeadsPerThread >= 1 && kHeadsPerThread <= 16,
              "FASTFFN_ROTARY_HEADS_PER_THREAD must be 1..16 (the swept values are 1, 2, 4, 8)");

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

// Token t's position (position_ids, or t % seq without them): whether the cos/sin table has it, and
// the offset of its row in the table (row 0 when not). An out-of-table position is never read: the
// block reports it and poisons the token's q and k outputs.
template <typename T>
__device__ __forceinline__ bool token_position(const RotaryTensors<T>& x,
                                               const int64_t* __restrict__ position_ids,
                                               const fastffn_rotary_args& a, int64_t t, int q_heads,
                                               int k_heads, int head_dim, int64_t& row) {
  const int64_t p = position_ids ? position_ids[t] : t % a.seq;
  const bool in_table = p >= 0 && p < a.table_rows;
  if (!in_table) {  // never read out of bounds; report and poison the token
    if (threadIdx.x == 0 && a.position_error != nullptr) *a.position_error = 1;
    write_nan_heads(x.q_out, a.q_out, t, q_heads, head_dim);
    write_nan_heads(x.k_out, a.k_out, t, k_heads, head_dim);
  }
  row = (in_table ? p : 0) * head_dim;
  return in_table;
}

// Where head `head` of token t is read and written: q heads first, then k heads, then v's copy
// heads (the order of rotary_kernel's work index, for one head per thread or several).
template <typename T>
struct HeadRow {
  const T* src;
  T* dst;
};

template <typename T>
__device__ __forceinline__ HeadRow<T> head_row(const RotaryTensors<T>& x, const fastffn_rotary_args& a,
                                               int64_t t, int head, int q_heads, int rotated_heads) {
  if (head >= rotated_heads) {
    const int vh = head - rotated_heads;
    return {x.v + head_offset(a.v_in, t, vh), x.v_out + head_offset(a.v_out, t, vh)};
  }
  if (head < q_heads) return {x.q + head_offset(a.q_in, t, head), x.q_out + head_offset(a.q_out, t, head)};
  return {x.k + head_offset(a.k_in, t, head - q_heads), x.k_out + head_offset(a.k_out, t, head - q_heads)};
}

// Rotates the pair (x[j], x[j + half]) of V elements in fp32; kInverse: the transposed rotation
// (the backward).
template <bool kInverse, typename T, int V>
__device__ __forceinline__ void rotate_pair(const Vec<T, V>& lo, const Vec<T, V>& hi, const float (&c_lo)[V],
                                            const float (&c_hi)[V], const float (&s_lo)[V],
                                            const float (&s_hi)[V], Vec<T, V>& out_lo, Vec<T, V>& out_hi) {
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
}

// kHeads == 1 (FASTFFN_ROTARY_HEADS_PER_THREAD's default): a thread per (head, vector j) item.
// kHeads > 1: a thread owns one vector j and the heads set, set + sets, ... (kHeads of them at
// most; adjacent threads of a warp take adjacent j, then adjacent heads, so a warp's accesses stay
// contiguous within a head and across neighbouring heads). It loads j's cos/sin once for all its
// heads (none when all its heads are v's copies), issues every head's loads before its first store
// (the in-flight loads that `#pragma unroll 4` gives the one-head loop), then rotates or copies
// and stores.
template <typename T, int V, bool kInverse, int kHeads>
__global__ void __launch_bounds__(kThreads)
rotary_kernel(RotaryTensors<T> x, const float* __restrict__ cos, const float* __restrict__ sin,
              const int64_t* __restrict__ position_ids, fastffn_rotary_args a, int64_t tokens) {
  const int head_dim = static_cast<int>(a.head_dim);
  const int q_heads = static_cast<int>(a.q_heads);
  const int k_heads = static_cast<int>(a.k_heads);
  const int half = head_dim / 2;
  const int vecs_per_half = half / V;
  const int rotated_heads = q_heads + k_heads;
  const int all_heads = rotated_heads + (x.v != nullptr ? k_heads : 0);
  const int sets = (all_heads + kHeads - 1) / kHeads;  // kHeads == 1: every head its own set
  const int work = sets * vecs_per_half;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    int64_t row;
    const bool in_table = token_position(x, position_ids, a, t, q_heads, k_heads, head_dim, row);
    const float* c = cos + row;
    const float* s = sin + row;
    if constexpr (kHeads == 1) {
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
        rotate_pair<kInverse>(lo, hi, c_lo, c_hi, s_lo, s_hi, out_lo, out_hi);
        store_vec<V>(dst + j, out_lo);
        store_vec<V>(dst + half + j, out_hi);
      }
    } else {
      for (int w = threadIdx.x; w < work; w += blockDim.x) {
        const int set = w / vecs_per_half;
        const int j = (w - set * vecs_per_half) * V;
        // A head is this thread's to write when it exists and is v's copy or rotated at a valid position.
        auto owned = [&](int head) { return head < all_heads && (head >= rotated_heads || in_table); };
        float c_lo[V], c_hi[V], s_lo[V], s_hi[V];
        if (in_table && set < rotated_heads) {  // set is its smallest head: else all are v's copies
          load_floats<V>(c + j, c_lo);
          load_floats<V>(c + half + j, c_hi);
          load_floats<V>(s + j, s_lo);
          load_floats<V>(s + half + j, s_hi);
        }
        Vec<T, V> lo[kHeads], hi[kHeads];
#pragma unroll
        for (int i = 0; i < kHeads; ++i) {
          const int head = set + i * sets;
          if (!owned(head)) continue;
          const T* src = head_row(x, a, t, head, q_heads, rotated_heads).src;
          lo[i] = load_vec<V>(src + j);
          hi[i] = load_vec<V>(src + half + j);
        }
#pragma unroll
        for (int i = 0; i < kHeads; ++i) {
          const int head = set + i * sets;
          if (!owned(head)) continue;
          T* dst = head_row(x, a, t, head, q_heads, rotated_heads).dst;
          if (head >= rotated_heads) {  // v: a copy, position-independent
            store_vec<V>(dst + j, lo[i]);
            store_vec<V>(dst + half + j, hi[i]);
            continue;
          }
          Vec<T, V> out_lo, out_hi;
          rotate_pair<kInverse>(lo[i], hi[i], c_lo, c_hi, s_lo, s_hi, out_lo, out_hi);
          store_vec<V>(dst + j, out_lo);
          store_vec<V>(dst + half + j, out_hi);
        }
      }
    }
  }
}

// rotary_kernel's block for kHeads > 1: its (set, j) items of one token, in whole warps, at most
// kThreads (a block of kThreads with fewer items would leave threads idle; the smaller block lets
// more tokens' blocks share an SM instead).
int heads_kernel_threads(const fastffn_rotary_args& a, int v_heads, int vec_width, int heads_per_thread) {
  const int64_t all_heads = a.q_heads + a.k_heads + v_heads;
  const int64_t sets = (all_heads + heads_per_thread - 1) / heads_per_thread;
  const int64_t work = sets * (a.head_dim / 2 / vec_width);
  const int64_t threads = (work + 31) / 32 * 32;
  return static_cast<int>(threads < kThreads ? threads : kThreads);
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
        // One head per thread: kThreads threads; more: the (set, j) items of a token, in whole warps.
        const int threads = kHeadsPerThread == 1
            ? kThreads
            : heads_kernel_threads(a, with_v ? static_cast<int>(a.k_heads) : 0, V, kHeadsPerThread);
        rotary_kernel<T, V, kInverse, kHeadsPerThread><<<grid, threads, 0, s>>>(
            tensors, cos, sin, position_ids, a, tokens);
        return launch_status();
      });
    });
  });
}
