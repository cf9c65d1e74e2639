// Shared pieces of the CUDA kernels: storage types and fp32 conversion, 16-byte vectors, the
// dtype / bool switches that turn runtime flags into template parameters, a block reduction and
// the launch-status check. Framework-neutral: CUDA runtime headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "fastffn/c_api.h"
#include "../validate.h"

namespace fastffn {
namespace cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Rounds to the storage dtype and back (where PaddleNLP's math stores an intermediate).
template <typename T>
__device__ __forceinline__ float round_to_storage(float v) { return to_float(from_float<T>(v)); }

// N elements of T moved as one aligned load/store (16 bytes when N = kVecWidth<T>).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T>
constexpr int kVecWidth = 16 / sizeof(T);

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// N consecutive fp32 values (cos/sin tables), loaded with the widest aligned accesses.
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + i);
      out[i] = f.x; out[i + 1] = f.y; out[i + 2] = f.z; out[i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = p[i];
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
inline bool stride_aligned16(int64_t stride_elems) {
  return (stride_elems * static_cast<int64_t>(sizeof(T))) % 16 == 0;
}

// Calls fn(T{}) with T the CUDA storage type of `dtype`; returns what fn returns.
template <typename Fn>
inline fastffn_status dispatch_dtype(fastffn_dtype dtype, Fn&& fn) {
  switch (dtype) {
    case FASTFFN_DTYPE_FLOAT32: return fn(float{});
    case FASTFFN_DTYPE_FLOAT16: return fn(__half{});
    case FASTFFN_DTYPE_BFLOAT16: return fn(__nv_bfloat16{});
    default:  // the entry points check the dtype first; this is the last line of defence
      return ::fastffn::fail(FASTFFN_STATUS_UNSUPPORTED_DTYPE, "fastffn CUDA dtype dispatch",
                             "%s is not a storage dtype of the CUDA kernels",
                             ::fastffn::dtype_name(dtype));
  }
}

// Runtime bool -> constexpr template parameter (flash-attention's BOOL_SWITCH, as a lambda).
#define FASTFFN_BOOL_SWITCH(COND, NAME, ...) \
  [&] {                                      \
    if (COND) {                              \
      constexpr bool NAME = true;            \
      return __VA_ARGS__();                  \
    } else {                                 \
      constexpr bool NAME = false;           \
      return __VA_ARGS__();                  \
    }                                        \
  }()

// The status of the launch just made (a bad configuration, or an earlier asynchronous error).
inline fastffn_status launch_status() {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return FASTFFN_STATUS_OK;
  return ::fastffn::fail(FASTFFN_STATUS_CUDA_ERROR, "fastffn kernel launch", "%s (%s)",
                         cudaGetErrorString(error), cudaGetErrorName(error));
}

// A CUDA runtime call's status, with the call named in fastffn_last_error on failure.
inline fastffn_status cuda_status(cudaError_t error, const char* entry, const char* call) {
  if (error == cudaSuccess) return FASTFFN_STATUS_OK;
  return ::fastffn::fail(FASTFFN_STATUS_CUDA_ERROR, entry, "%s: %s", call, cudaGetErrorString(error));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block, returned to every thread. `scratch` holds 32 floats of shared memory.
// Must be reached by all threads of the block.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = lane < warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// The current device's limits (device_limits.cu; cached per device).
fastffn_status current_device_limits(fastffn_device_limits* limits);

// Blocks of a persistent grid of `threads`-thread blocks: every SM filled to the kernel's
// occupancy (queried, with the device's SM count), never more blocks than work items.
template <typename Kernel>
int64_t persistent_blocks(Kernel kernel, int64_t items, int threads, int sm_count, size_t dynamic_shared = 0) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_shared) != cudaSuccess ||
      per_sm < 1)
    per_sm = 1;
  const int64_t cap = static_cast<int64_t>(per_sm) * (sm_count > 0 ? sm_count : 1);
  return items < 1 ? 1 : (items < cap ? items : cap);
}

inline unsigned int blocks_for(int64_t work, int threads, int64_t cap) {
  int64_t blocks = (work + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned int>(blocks < cap ? blocks : cap);
}

}  // namespace cuda
}  // namespace fastffn
