// AdamW on CUDA (fastffn/optimizer.h): one pass over the tensor. Each thread of a grid-stride
// loop updates 8 consecutive elements per iteration: one 16-byte vector of 16-bit values, two of
// fp32, so every access is a 16-byte load or store when all five pointers are 16-byte aligned; the
// n % 8 tail elements go one per thread. A misaligned pointer (a view into a fused buffer) runs
// the same update one element per thread. The grid holds kBlocksPerSm blocks per SM of the
// device (read at run time), enough loads in flight to stream at the device's bandwidth; the
// learning rate, beta powers and clip coefficient are read on the device, so nothing waits on
// the host and a CUDA graph of the step replays with their current values.
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

template <typename T, typename G, bool kMaster>
struct Tensors {
  T* __restrict__ param;
  const G* __restrict__ grad;
  float* __restrict__ master;
  float* __restrict__ moment1;
  float* __restrict__ moment2;

  // Elements [i, i + N): every load is issued before the math, every store after it.
  template <int N>
  __device__ __forceinline__ void update(const AdamwStep& s, int64_t i) const {
    float p[N], g[N], m1[N], m2[N];
    if constexpr (kMaster) load_as_float<N>(master + i, p);
    else load_as_float<N>(param + i, p);
    load_as_float<N>(grad + i, g);
    load_as_float<N>(moment1 + i, m1);
    load_as_float<N>(moment2 + i, m2);
#pragma unroll
    for (int k = 0; k < N; ++k) adamw_update(s, p[k], g[k], m1[k], m2[k]);
    store_from_float<N>(moment1 + i, m1);
    store_from_float<N>(moment2 + i, m2);
    if constexpr (kMaster) store_from_float<N>(master + i, p);
    store_from_float<N>(param + i, p);
  }
};

template <typename T, typename G, bool kMaster, int N>
__global__ void __launch_bounds__(kThreads)
adamw_kernel(fastffn_adamw_args a, Tensors<T, G, kMaster> t) {
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

__global__ void update_pows_kernel(float beta1, float beta2, float* beta1_pow, float* beta2_pow) {
  *beta1_pow = beta1 * *beta1_pow;
  *beta2_pow = beta2 * *beta2_pow;
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;

extern "C" fastffn_status fastffn_adamw_cuda(fastffn_adamw_args args, void* param,
                                             const void* grad, float* master, float* moment1,
                                             float* moment2, void* stream) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw(__func__, args, param, grad, moment1, moment2));
  if (args.n == 0) return FASTFFN_STATUS_OK;
  fastffn_device_limits limits;
  const fastffn_status queried = current_device_limits(&limits);
  if (queried != FASTFFN_STATUS_OK) return queried;
  const bool vector = aligned16(param) && aligned16(grad) && aligned16(moment1) &&
                      aligned16(moment2) && (master == nullptr || aligned16(master));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(args.param_dtype, [&](auto tag) {
    using T = decltype(tag);
    return FASTFFN_BOOL_SWITCH(args.grad_dtype == FASTFFN_DTYPE_FLOAT32, kFp32Grad, [&] {
      using G = std::conditional_t<kFp32Grad, float, T>;
      return FASTFFN_BOOL_SWITCH(master != nullptr, kMaster, [&] {
        return FASTFFN_BOOL_SWITCH(vector, kVector, [&] {
          constexpr int N = kVector ? kElems : 1;
          const Tensors<T, G, kMaster> t{static_cast<T*>(param), static_cast<const G*>(grad),
                                         master, moment1, moment2};
          const unsigned int blocks =
              blocks_for(args.n / N, kThreads, int64_t(kBlocksPerSm) * limits.sm_count);
          adamw_kernel<T, G, kMaster, N><<<blocks, kThreads, 0, s>>>(args, t);
          return launch_status();
        });
      });
    });
  });
}

extern "C" fastffn_status fastffn_adamw_update_pows_cuda(float beta1, float beta2,
                                                         float* beta1_pow, float* beta2_pow,
                                                         void* stream) {
  FASTFFN_TRY_STATUS(fastffn::check_adamw_pows(__func__, beta1_pow, beta2_pow));
  update_pows_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(beta1, beta2, beta1_pow,
                                                                     beta2_pow);
  return launch_status();
}
