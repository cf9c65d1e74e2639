// AdamW on CUDA (fastffn/optimizer.h): one pass over the tensor. Each thread of a grid-stride
// loop updates 8 consecutive elements per iteration: one 16-byte vector of 16-bit values, two of
// fp32, so every access is a 16-byte load or store when all five pointers are 16-byte aligned; the
// n % 8 tail elements go one per thread. A misaligned pointer (a view into a fused buffer) runs
// the same update one element per thread. The grid holds kBlocksPerSm blocks per SM of the
// device (read at run time), enough loads in flight to stream at the device's bandwidth; the
// learning rate, beta powers and clip coefficient are read on the device, so nothing waits on
// the host and a CUDA graph of the step replays with their current values. 8-bit moments run
// adamw_blockwise_kernel (below): one warp per 256-element quantisation block, 8 consecutive
// elements a lane moved as 16-byte vectors, the block's absmax a warp-shuffle reduction, the codes
// found through the maps and search tables each thread block builds in shared memory.
#include <type_traits>

#include "fp8_common.cuh"
#include "../adamw_math.h"
#include "../validate.h"

namespace fastffn {
namespace cuda {
namespace {

// Build-time knobs for `bench_optimizer --sweep`. H200, the 7B step's 1.88e9 parameters, bf16
// with fp32 masters, CUDA-graph timing (benchmarks/results/run12/optimizer_sweep.json at commit
// 8c5140e): 4 blocks per SM 15.41 ms (84.8% of copy bandwidth), 8 blocks 15.30 ms (85.4%), 16
// elements per thread 18.31 ms (71.4%, without spills); the streaming cache hint (ld/st.global.cs
// on every vector) 15.43 ms, no gain, so it is not used.
#ifndef FASTFFN_ADAMW_BLOCKS_PER_SM
#define FASTFFN_ADAMW_BLOCKS_PER_SM 8
#endif
#ifndef FASTFFN_ADAMW_ELEMS
#define FASTFFN_ADAMW_ELEMS 8
#endif

constexpr int kThreads = 256;
static_assert(kThreads == kTileThreads, "block_amax_to reduces over kTileThreads threads");
constexpr int kBlocksPerSm = FASTFFN_ADAMW_BLOCKS_PER_SM;
constexpr int kElems = FASTFFN_ADAMW_ELEMS;  // per thread and iteration on the vector path
static_assert(kElems % 8 == 0, "the vector path moves whole 16-byte vectors of 16-bit values");

__device__ __forceinline__ float read(fastffn_scalar s) {
  return s.ptr != nullptr ? *s.ptr : s.value;
}

// N consecutive elements as fp32, moved in vectors of up to 16 bytes.
template <int N, typename T>
__device__ __forceinline__ void load_as_float(const T* p, float (&out)[N]) {
  constexpr int W = N < kVecWidth<T> ? N : kVecWidth<T>;
#pragma unroll
  for (int c = 0; c < N / W; ++c) {
    const Vec<T, W> v = load_vec<W>(p + c * W);
#pragma unroll
    for (int k = 0; k < W; ++k) out[c * W + k] = to_float(v.v[k]);
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_from_float(T* p, const float (&in)[N]) {
  constexpr int W = N < kVecWidth<T> ? N : kVecWidth<T>;
#pragma unroll
  for (int c = 0; c < N / W; ++c) {
    Vec<T, W> v;
#pragma unroll
    for (int k = 0; k < W; ++k) v.v[k] = from_float<T>(in[c * W + k]);
    store_vec<W>(p + c * W, v);
  }
}

template <typename T, typename G, Weight W>
struct Tensors {
  T* __restrict__ param;
  const G* __restrict__ grad;
  float* __restrict__ master;
  T* __restrict__ compensation;
  float* __restrict__ moment1;
  float* __restrict__ moment2;
  unsigned int* param_amax;  // fastffn_adamw_state.param_amax as fp32 bits, or NULL

  template <int N>
  __device__ __forceinline__ void load_weights(int64_t i, float (&p)[N]) const {
    if constexpr (W == Weight::kMaster) {
      load_as_float<N>(master + i, p);
    } else {
      load_as_float<N>(param + i, p);
      if constexpr (W == Weight::kCompensated) {
        float c[N];
        load_as_float<N>(compensation + i, c);
#pragma unroll
        for (int k = 0; k < N; ++k) p[k] += c[k];
      }
    }
  }

  // Also max-accumulates the bits of |param| as stored into `amax` (the thread's share of
  // param_amax; a few integer ops beside a memory-bound update).
  template <int N>
  __device__ __forceinline__ void store_weights(int64_t i, const float (&p)[N], uint32_t& amax) const {
    if constexpr (W == Weight::kMaster) store_from_float<N>(master + i, p);
    if constexpr (W == Weight::kCompensated) {
      float c[N];
#pragma unroll
      for (int k = 0; k < N; ++k) c[k] = p[k] - round_to_storage<T>(p[k]);
      store_from_float<N>(compensation + i, c);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) amax = max(amax, abs_bits(round_to_storage<T>(p[k])));
    store_from_float<N>(param + i, p);
  }

  // The block's amax into param_amax: after the grid-stride loop, every thread of the block.
  __device__ __forceinline__ void finish_amax(uint32_t amax, uint32_t* scratch) const {
    if (param_amax != nullptr) block_amax_to(param_amax, amax, scratch);
  }

  // Elements [i, i + N): every load is issued before the math, every store after it.
  template <int N>
  __device__ __forceinline__ void update(const AdamwStep& s, int64_t i, uint32_t& amax) const {
    float p[N], g[N], m1[N], m2[N];
    load_weights<N>(i, p);
    load_as_float<N>(grad + i, g);
    load_as_float<N>(moment1 + i, m1);
    load_as_float<N>(moment2 + i, m2);
#pragma unroll
    for (int k = 0; k < N; ++k) adamw_update(s, p[k], g[k], m1[k], m2[k]);
    store_from_float<N>(moment1 + i, m1);
    store_from_float<N>(moment2 + i, m2);
    store_weights<N>(i, p, amax);
  }
};

template <typename T, typename G, Weight W, int N>
__global__ void __launch_bounds__(kThreads)
adamw_kernel(fastffn_adamw_args a, Tensors<T, G, W> t) {
  const AdamwStep s =
      adamw_step(a, read(a.lr), read(a.beta1_pow), read(a.beta2_pow), read(a.grad_scale));
  const int64_t groups = a.n / N;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t amax = 0;
  for (int64_t i = first; i < groups; i += stride) t.template update<N>(s, i * N, amax);
  if constexpr (N > 1) {
    const int64_t tail = groups * N + first;
    if (tail < a.n) t.template update<1>(s, tail, amax);
  }
  __shared__ uint32_t warp_amax[kThreads / 32];
  t.finish_amax(amax, warp_amax);
}

// --- 8-bit blockwise moments ---------------------------------------------------------------
// One warp owns one quantisation block at a time (warps grid-stride over the blocks), each lane
// kLaneElems consecutive elements: the block's 16-bit values move as one 16-byte vector a lane,
// its codes as one 8-byte vector, and the absmax is a warp-shuffle reduction (no barrier). The
// last, partial block and misaligned pointers take the same organisation element by element.
// Each thread block first builds the maps and their search tables (DynamicMapTables) in shared
// memory, once for all the quantisation blocks it visits.
constexpr int kQuantThreads = 256;
constexpr int kQuantWarps = kQuantThreads / 32;
constexpr int kLaneElems = kQuantBlock / 32;
static_assert(kQuantBlock % 32 == 0 && kLaneElems % 8 == 0, "whole 8-element vectors per lane");
static_assert(2 * kGuessSize % kQuantThreads == 0, "every thread fills as many search-table entries");

// max over the warp (NaN kept), every lane receives it: max is exact, so the order of the
// butterfly does not matter.
__device__ __forceinline__ float warp_nan_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

template <typename T, typename G, Weight W>
struct BlockwiseTensors {
  Tensors<T, G, W> weights;  // param, grad, master, compensation (its moment pointers unused)
  uint8_t* __restrict__ codes1;
  uint8_t* __restrict__ codes2;
  float* __restrict__ absmax1;
  float* __restrict__ absmax2;

  // The lane's elements [i, i + kLaneElems) of quantisation block b, of which the first `count`
  // exist. kVector: all of them exist and every pointer is 16-byte aligned. Reached by all 32
  // lanes of the warp (the absmax is a shuffle). The lane's share of param_amax goes to the thread
  // block's `block_amax` (shared memory) at the end: a register carried across the grid-stride
  // loop spilled in the misaligned variant.
  template <bool kVector>
  __device__ __forceinline__ void update(const AdamwStep& s, const DynamicMapTables& maps,
                                         int64_t b, int64_t i, int count, uint32_t* block_amax) const {
    uint32_t amax = 0;
    constexpr int N = kLaneElems;
    float p[N], g[N], m1[N], m2[N];
    uint8_t c1[N], c2[N];
    if constexpr (kVector) {
      weights.template load_weights<N>(i, p);
      load_as_float<N>(weights.grad + i, g);
      load_codes(codes1 + i, c1);
      load_codes(codes2 + i, c2);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (k >= count) break;
        float pk[1], gk[1];
        weights.template load_weights<1>(i + k, pk);
        load_as_float<1>(weights.grad + i + k, gk);
        p[k] = pk[0];
        g[k] = gk[0];
        c1[k] = codes1[i + k];
        c2[k] = codes2[i + k];
      }
    }
    const float scale1 = absmax1[b], scale2 = absmax2[b];
    float max1 = 0.f, max2 = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (!kVector && k >= count) break;
      m1[k] = maps.map[0][c1[k]] * scale1;
      m2[k] = maps.map[1][c2[k]] * scale2;
      adamw_update(s, p[k], g[k], m1[k], m2[k]);
      max1 = nan_max(max1, fabsf(m1[k]));
      max2 = nan_max(max2, fabsf(m2[k]));
    }
    if constexpr (kVector) {
      weights.template store_weights<N>(i, p, amax);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (k >= count) break;
        const float pk[1] = {p[k]};
        weights.template store_weights<1>(i + k, pk, amax);
      }
    }
    if (weights.param_amax != nullptr) {
      amax = __reduce_max_sync(0xffffffffu, amax);
      if (threadIdx.x % 32 == 0) atomicMax(block_amax, amax);
    }
    max1 = warp_nan_max(max1);  // every lane has read absmax[b] before lane 0 overwrites it
    max2 = warp_nan_max(max2);
    if (threadIdx.x % 32 == 0) {
      absmax1[b] = max1;
      absmax2[b] = max2;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (!kVector && k >= count) break;
      c1[k] = static_cast<uint8_t>(quantize(maps, true, m1[k], max1));
      c2[k] = static_cast<uint8_t>(quantize(maps, false, m2[k], max2));
    }
    if constexpr (kVector) {
      store_codes(codes1 + i, c1);
      store_codes(codes2 + i, c2);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (k >= count) break;
        codes1[i + k] = c1[k];
        codes2[i + k] = c2[k];
      }
    }
  }

  __device__ __forceinline__ static void load_codes(const uint8_t* p, uint8_t (&out)[kLaneElems]) {
#pragma unroll
    for (int c = 0; c < kLaneElems; c += 8) {
      const Vec<uint8_t, 8> v = load_vec<8>(p + c);
#pragma unroll
      for (int k = 0; k < 8; ++k) out[c + k] = v.v[k];
    }
  }

  __device__ __forceinline__ static void store_codes(uint8_t* p, const uint8_t (&in)[kLaneElems]) {
#pragma unroll
    for (int c = 0; c < kLaneElems; c += 8) {
      Vec<uint8_t, 8> v;
#pragma unroll
      for (int k = 0; k < 8; ++k) v.v[k] = in[c + k];
      store_vec<8>(p + c, v);
    }
  }
};

template <typename T, typename G, Weight W, bool kVector>
__global__ void __launch_bounds__(kQuantThreads)
adamw_blockwise_kernel(fastffn_adamw_args a, BlockwiseTensors<T, G, W> t) {
  __shared__ DynamicMapTables maps;
  __shared__ uint32_t block_amax;  // param_amax's bits over this thread block's elements
  if (threadIdx.x == 0) block_amax = 0;
  for (int i = threadIdx.x; i < 2 * kMapSize; i += kQuantThreads) fill_map_entry(maps, i);
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2 * kGuessSize / kQuantThreads; ++r) fill_guess_entry(maps, r * kQuantThreads + threadIdx.x);
  __syncthreads();
  const AdamwStep s =
      adamw_step(a, read(a.lr), read(a.beta1_pow), read(a.beta2_pow), read(a.grad_scale));
  const int lane = threadIdx.x % 32;
  const int64_t blocks = (a.n + kQuantBlock - 1) / kQuantBlock;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kQuantWarps;
  for (int64_t b = blockIdx.x * int64_t(kQuantWarps) + threadIdx.x / 32; b < blocks; b += stride) {
    const int64_t i = b * kQuantBlock + lane * kLaneElems;
    if (kVector && (b + 1) * kQuantBlock <= a.n) {
      t.template update<true>(s, maps, b, i, kLaneElems, &block_amax);
    } else {
      const int64_t left = a.n - i;
      t.template update<false>(s, maps, b, i, left < 0 ? 0 : (left < kLaneElems ? int(left) : kLaneElems),
                               &block_amax);
    }
  }
  if (t.weights.param_amax != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0 && block_amax != 0) atomicMax(t.weights.param_amax, block_amax);
  }
}

__global__ void update_pows_kernel(float beta1, float beta2, float* beta1_pow, float* beta2_pow) {
  *beta1_pow = beta1 * *beta1_pow;
  *beta2_pow = beta2 * *beta2_pow;
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;
using fastffn::dispatch_weight;
using fastffn::kQuantBlock;
using fastffn::Weight;

extern "C" fastffn_status fastffn_adamw_with_state_cuda(fastffn_adamw_args args, void* param,
                                                        const void* grad,
                                                        fastffn_adamw_state state, void* stream) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw_state(__func__, args, param, grad, state));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // param_amax is written, not accumulated: zeroed here, then each block's max is an atomicMax.
  if (state.param_amax != nullptr) {
    FASTFFN_TRY_STATUS(cuda_status(cudaMemsetAsync(state.param_amax, 0, sizeof(float), s), __func__,
                                   "cudaMemsetAsync(param_amax)"));
  }
  if (args.n == 0) return FASTFFN_STATUS_OK;
  fastffn_device_limits limits;
  const fastffn_status queried = current_device_limits(&limits);
  if (queried != FASTFFN_STATUS_OK) return queried;
  const bool blockwise = state.moments == FASTFFN_MOMENTS_BLOCKWISE_8BIT;
  const bool vector = aligned16(param) && aligned16(grad) && aligned16(state.moment1) &&
                      aligned16(state.moment2) && (state.master == nullptr || aligned16(state.master)) &&
                      (state.compensation == nullptr || aligned16(state.compensation));
  return dispatch_dtype(args.param_dtype, [&](auto tag) {
    using T = decltype(tag);
    return FASTFFN_BOOL_SWITCH(args.grad_dtype == FASTFFN_DTYPE_FLOAT32, kFp32Grad, [&] {
      using G = std::conditional_t<kFp32Grad, float, T>;
      return dispatch_weight(state, [&](auto weight_tag) {
        constexpr Weight W = decltype(weight_tag)::value;
        if constexpr (W == Weight::kCompensated && std::is_same_v<T, float>) {
          return FASTFFN_STATUS_UNSUPPORTED_DTYPE;  // check_adamw_state refused it already
        } else {
          const Tensors<T, G, W> t{static_cast<T*>(param), static_cast<const G*>(grad), state.master,
                                   static_cast<T*>(state.compensation),
                                   static_cast<float*>(state.moment1),
                                   static_cast<float*>(state.moment2),
                                   reinterpret_cast<unsigned int*>(state.param_amax)};
          if (blockwise) {
            const BlockwiseTensors<T, G, W> q{t, static_cast<uint8_t*>(state.moment1),
                                              static_cast<uint8_t*>(state.moment2), state.absmax1,
                                              state.absmax2};
            const int64_t warp_items = ((args.n + kQuantBlock - 1) / kQuantBlock + kQuantWarps - 1) / kQuantWarps;
            return FASTFFN_BOOL_SWITCH(vector, kVector, [&] {
              const auto kernel = adamw_blockwise_kernel<T, G, W, kVector>;
              const int64_t grid = persistent_blocks(kernel, warp_items, kQuantThreads, limits.sm_count);
              kernel<<<static_cast<unsigned int>(grid), kQuantThreads, 0, s>>>(args, q);
              return launch_status();
            });
          }
          return FASTFFN_BOOL_SWITCH(vector, kVector, [&] {
            constexpr int N = kVector ? kElems : 1;
            const unsigned int blocks =
                blocks_for(args.n / N, kThreads, int64_t(kBlocksPerSm) * limits.sm_count);
            adamw_kernel<T, G, W, N><<<blocks, kThreads, 0, s>>>(args, t);
            return launch_status();
          });
        }
      });
    });
  });
}

extern "C" fastffn_status fastffn_adamw_cuda(fastffn_adamw_args args, void* param,
                                             const void* grad, float* master, float* moment1,
                                             float* moment2, void* stream) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw(__func__, args, param, grad, moment1, moment2));
  const fastffn_adamw_state state{FASTFFN_MOMENTS_FLOAT32, moment1, moment2, nullptr, nullptr,
                                  master, nullptr, nullptr};
  return fastffn_adamw_with_state_cuda(args, param, grad, state, stream);
}

extern "C" fastffn_status fastffn_adamw_update_pows_cuda(float beta1, float beta2,
                                                         float* beta1_pow, float* beta2_pow,
                                                         void* stream) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw_pows(__func__, beta1_pow, beta2_pow));
  update_pows_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(beta1, beta2, beta1_pow,
                                                                     beta2_pow);
  return launch_status();
}
