// AdamW on CUDA (fastffn/optimizer.h): one pass over the tensor. Each thread of a grid-stride
// loop updates 8 consecutive elements per iteration: one 16-byte vector of 16-bit values, two of
// fp32, so every access is a 16-byte load or store when all five pointers are 16-byte aligned; the
// n % 8 tail elements go one per thread. A misaligned pointer (a view into a fused buffer) runs
// the same update one element per thread. The grid holds kBlocksPerSm blocks per SM of the
// device (read at run time), enough loads in flight to stream at the device's bandwidth; the
// learning rate, beta powers and clip coefficient are read on the device, so nothing waits on
// the host and a CUDA graph of the step replays with their current values. 8-bit moments run
// adamw_blockwise_kernel (below), one quantisation block per thread block at a time.
#include <type_traits>

#include "cuda_common.cuh"
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

  template <int N>
  __device__ __forceinline__ void store_weights(int64_t i, const float (&p)[N]) const {
    if constexpr (W == Weight::kMaster) store_from_float<N>(master + i, p);
    if constexpr (W == Weight::kCompensated) {
      float c[N];
#pragma unroll
      for (int k = 0; k < N; ++k) c[k] = p[k] - round_to_storage<T>(p[k]);
      store_from_float<N>(compensation + i, c);
    }
    store_from_float<N>(param + i, p);
  }

  // Elements [i, i + N): every load is issued before the math, every store after it.
  template <int N>
  __device__ __forceinline__ void update(const AdamwStep& s, int64_t i) const {
    float p[N], g[N], m1[N], m2[N];
    load_weights<N>(i, p);
    load_as_float<N>(grad + i, g);
    load_as_float<N>(moment1 + i, m1);
    load_as_float<N>(moment2 + i, m2);
#pragma unroll
    for (int k = 0; k < N; ++k) adamw_update(s, p[k], g[k], m1[k], m2[k]);
    store_from_float<N>(moment1 + i, m1);
    store_from_float<N>(moment2 + i, m2);
    store_weights<N>(i, p);
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
  for (int64_t i = first; i < groups; i += stride) t.template update<N>(s, i * N);
  if constexpr (N > 1) {
    const int64_t tail = groups * N + first;
    if (tail < a.n) t.template update<1>(s, tail);
  }
}

// --- 8-bit blockwise moments ---------------------------------------------------------------
// A thread block owns whole quantisation blocks (grid-stride over them): kQuantThreads threads,
// each kQuantBlock / kQuantThreads elements strided by kQuantThreads, so that every load and store
// of a warp is one contiguous run (no alignment needed); the block's absmax is a reduction across
// the thread block. 32 such blocks per SM fill an SM's 2048 threads.
constexpr int kQuantThreads = 64;
constexpr int kQuantPerThread = kQuantBlock / kQuantThreads;
constexpr int kQuantBlocksPerSm = 32;
static_assert(kQuantBlock % kQuantThreads == 0 && kQuantThreads % 32 == 0, "whole warps per block");

// max over the thread block of a and of b (NaN kept), every thread receives both.
__device__ __forceinline__ void block_nan_max(float& a, float& b, float (*partial)[kQuantThreads / 32]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    a = nan_max(a, __shfl_xor_sync(0xffffffffu, a, offset));
    b = nan_max(b, __shfl_xor_sync(0xffffffffu, b, offset));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    partial[0][warp] = a;
    partial[1][warp] = b;
  }
  __syncthreads();
  a = partial[0][0];
  b = partial[1][0];
#pragma unroll
  for (int w = 1; w < kQuantThreads / 32; ++w) {
    a = nan_max(a, partial[0][w]);
    b = nan_max(b, partial[1][w]);
  }
}

template <typename T, typename G, Weight W>
struct BlockwiseTensors {
  Tensors<T, G, W> weights;  // param, grad, master, compensation (its moment pointers unused)
  uint8_t* __restrict__ codes1;
  uint8_t* __restrict__ codes2;
  float* __restrict__ absmax1;
  float* __restrict__ absmax2;
};

template <typename T, typename G, Weight W>
__global__ void __launch_bounds__(kQuantThreads)
adamw_blockwise_kernel(fastffn_adamw_args a, BlockwiseTensors<T, G, W> t) {
  __shared__ float map1[kMapSize], map2[kMapSize];
  __shared__ float partial[2][kQuantThreads / 32];
  for (int c = threadIdx.x; c < kMapSize; c += kQuantThreads) {
    map1[c] = dynamic_map_value(c, true);
    map2[c] = dynamic_map_value(c, false);
  }
  __syncthreads();
  const AdamwStep s =
      adamw_step(a, read(a.lr), read(a.beta1_pow), read(a.beta2_pow), read(a.grad_scale));
  const int64_t blocks = (a.n + kQuantBlock - 1) / kQuantBlock;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const float scale1 = t.absmax1[b], scale2 = t.absmax2[b];
    float m1[kQuantPerThread], m2[kQuantPerThread];
    float max1 = 0.f, max2 = 0.f;
#pragma unroll
    for (int k = 0; k < kQuantPerThread; ++k) {
      const int64_t i = b * kQuantBlock + k * kQuantThreads + threadIdx.x;
      m1[k] = m2[k] = 0.f;
      if (i >= a.n) continue;
      float p[1], g[1];
      t.weights.template load_weights<1>(i, p);
      load_as_float<1>(t.weights.grad + i, g);
      m1[k] = map1[t.codes1[i]] * scale1;
      m2[k] = map2[t.codes2[i]] * scale2;
      adamw_update(s, p[0], g[0], m1[k], m2[k]);
      t.weights.template store_weights<1>(i, p);
      max1 = nan_max(max1, fabsf(m1[k]));
      max2 = nan_max(max2, fabsf(m2[k]));
    }
    block_nan_max(max1, max2, partial);  // every thread has read absmax[b] before this
    if (threadIdx.x == 0) {
      t.absmax1[b] = max1;
      t.absmax2[b] = max2;
    }
#pragma unroll
    for (int k = 0; k < kQuantPerThread; ++k) {
      const int64_t i = b * kQuantBlock + k * kQuantThreads + threadIdx.x;
      if (i >= a.n) continue;
      t.codes1[i] = static_cast<uint8_t>(quantize(map1, m1[k], max1));
      t.codes2[i] = static_cast<uint8_t>(quantize(map2, m2[k], max2));
    }
    __syncthreads();  // `partial` is rewritten by the next block's reduction
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
  if (args.n == 0) return FASTFFN_STATUS_OK;
  fastffn_device_limits limits;
  const fastffn_status queried = current_device_limits(&limits);
  if (queried != FASTFFN_STATUS_OK) return queried;
  const bool blockwise = state.moments == FASTFFN_MOMENTS_BLOCKWISE_8BIT;
  const bool vector = aligned16(param) && aligned16(grad) && aligned16(state.moment1) &&
                      aligned16(state.moment2) && (state.master == nullptr || aligned16(state.master)) &&
                      (state.compensation == nullptr || aligned16(state.compensation));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
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
                                   static_cast<float*>(state.moment2)};
          if (blockwise) {
            const BlockwiseTensors<T, G, W> q{t, static_cast<uint8_t*>(state.moment1),
                                              static_cast<uint8_t*>(state.moment2), state.absmax1,
                                              state.absmax2};
            const int64_t quant_blocks = (args.n + kQuantBlock - 1) / kQuantBlock;
            const unsigned int grid =
                blocks_for(quant_blocks, 1, int64_t(kQuantBlocksPerSm) * limits.sm_count);
            adamw_blockwise_kernel<T, G, W><<<grid, kQuantThreads, 0, s>>>(args, q);
            return launch_status();
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
                                  master, nullptr};
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
