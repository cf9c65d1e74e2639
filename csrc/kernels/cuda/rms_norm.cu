// RMSNorm (+ fused residual add) forward and backward on CUDA, PaddleNLP LlamaRMSNorm numerics.
// Forward: rows that fit in registers are read once (the plain norm through a persistent kernel
// that keeps the next row's loads in flight, the fused add one block per row); wider rows, and the
// backward, one block per row (grid-stride over rows), reading each row twice: the second read of
// a row of a few KiB hits L1/L2, so DRAM traffic stays one read per input, while any width works
// without holding the row in registers. The backward keeps each block's weight-gradient partial sums in
// shared memory where the device's limit allows (each thread owns its columns: no atomics), in
// the workspace otherwise, and a second small kernel reduces the per-block partials in fp32. The
// block count and that choice come from fastffn_plan_rms_norm_bwd and the device's limits.
// Measured and rejected on the H200 (files in benchmarks/results/ at commit 8c5140e:
// history/gpu_h200_run6_rms_norm_variants.json, run11/rms_norm_bwd_registers_rejected.json,
// run14/rms_norm_occupancy_rejected.json): a warp-per-row forward with the row in registers (plain
// 68% vs 73% of copy bandwidth at hidden 4096, fused add 58% vs 93%) and a backward with the row and
// the weight-gradient partials in registers (61% vs 69% fwd+bwd at 4096): both slower at every
// LLaMA-2 width. A persistent backward with the row, the weight slice and the partials in registers
// and the next row prefetched ran the plain fwd+bwd at 65/53/65% and the fused add at 62/53/63%
// (7B/13B/70B) against 69/72/66% and 67/70/68% for the loop kernel; at 90-124 registers only two
// 256-thread blocks fit per SM. The plain forward on the one-row-per-block kernel held to 32
// registers (full occupancy, 2048 threads per SM: 8 blocks of 256 at 7B, Liger's), ran within 2%
// of the persistent kernel (7B/13B/70B: 42.1/52.4/83.0 against 41.9/53.5/82.8 us; Liger
// 37.4/57.9/71.6 us): the gap to Liger at 7B and 70B is not occupancy. The forward kernels below
// share their row-sum and store code only in shape: one helper for both changed the 8-vector
// cached kernel's register allocation into spills.
#include <type_traits>

#include "cuda_common.cuh"
#include "../validate.h"

namespace fastffn {
namespace cuda {
namespace {

constexpr int64_t kMaxRowBlocks = int64_t(1) << 30;

int threads_for(int64_t vecs) {
  int64_t t = (vecs + 1) / 2;  // about two vectors per thread
  t = (t + 31) / 32 * 32;
  return static_cast<int>(t < 64 ? 64 : (t > 512 ? 512 : t));
}

// Fast path: the row lives in registers (kItems vectors per thread), so all its loads are in
// flight at once and it is read from memory exactly once. Used when the row fits in
// kMaxCachedItems vectors x kMaxCachedThreads threads; wider rows take the loop kernel below.
constexpr int kMaxCachedThreads = 512;
constexpr int kMaxCachedItems = 8;

template <typename T, int V, int kItems, bool kResidual>
__global__ void __launch_bounds__(kMaxCachedThreads)
rms_norm_fwd_cached_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                           const T* __restrict__ weight, T* __restrict__ out,
                           T* __restrict__ sum_out, float* __restrict__ rstd, int64_t rows,
                           int64_t cols, float epsilon) {
  __shared__ float scratch[32];
  const int64_t vecs = cols / V;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    Vec<T, V> xv[kItems];
    float sq = 0.f;
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(it) * blockDim.x;
      if (i < vecs) {
        xv[it] = load_vec<V>(x + row * cols + i * V);
        if constexpr (kResidual) {
          const Vec<T, V> rv = load_vec<V>(residual + row * cols + i * V);
#pragma unroll
          for (int k = 0; k < V; ++k)
            xv[it].v[k] = from_float<T>(to_float(xv[it].v[k]) + to_float(rv.v[k]));
          store_vec<V>(sum_out + row * cols + i * V, xv[it]);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float f = to_float(xv[it].v[k]);
          sq += f * f;
        }
      }
    }
    const float inv = rsqrtf(block_sum(sq, scratch) / static_cast<float>(cols) + epsilon);
    if (threadIdx.x == 0) rstd[row] = inv;
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(it) * blockDim.x;
      if (i < vecs) {
        // Loaded after the reduction on purpose: loading it with the row was measured slower
        // (62% vs 73% of copy bandwidth at hidden 4096; benchmarks/results/gpu_h200_rms_norm_sweep.json
        // at commit 8c5140e).
        const Vec<T, V> w = load_vec<V>(weight + i * V);
        Vec<T, V> ov;
#pragma unroll
        for (int k = 0; k < V; ++k)
          ov.v[k] = from_float<T>(round_to_storage<T>(to_float(xv[it].v[k]) * inv) * to_float(w.v[k]));
        store_vec<V>(out + row * cols + i * V, ov);
      }
    }
  }
}

// The plain norm's fast path: a persistent grid (every SM filled to the kernel's occupancy) whose
// blocks walk the rows, one row in registers (kItems vectors per thread). Each thread always owns
// the same columns, so its slice of the weight is loaded once per block, not once per row, and
// the next row is loaded before this row's reduction, so that loads stay in flight through the
// barriers and the stores. Why: the plain norm moves half the bytes per row of the fused add, and
// with one row in flight per block (the kernel above) it sat at 67-73% of copy bandwidth where the
// fused add reached 92-95% (benchmarks/results/gpu_h200_run7.json at commit 8c5140e). Two rows and the weight slice in registers: up to
// kMaxPrefetchItems vectors per thread (rows up to 8192 bf16 / 4096 fp32 columns, every LLaMA
// width; 4 fp32 and 8 bf16 vectors spill under the launch bound's 128 registers). The fused add
// keeps the kernel above: its two inputs per row already keep twice the loads in flight.
constexpr int kMaxPrefetchItems = 2;

template <typename T, int V, int kItems>
__device__ __forceinline__ void load_row(Vec<T, V> (&row)[kItems], const T* __restrict__ src, int64_t vecs) {
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(it) * blockDim.x;
    if (i < vecs) row[it] = load_vec<V>(src + i * V);
  }
}

template <typename T, int V, int kItems>
__global__ void __launch_bounds__(kMaxCachedThreads)
rms_norm_fwd_prefetch_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ out,
                             float* __restrict__ rstd, int64_t rows, int64_t cols, float epsilon) {
  __shared__ float scratch[32];
  const int64_t vecs = cols / V;
  Vec<T, V> w[kItems], cur[kItems], next[kItems];
  load_row<T, V, kItems>(w, weight, vecs);
  if (blockIdx.x < rows) load_row<T, V, kItems>(next, x + blockIdx.x * cols, vecs);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
#pragma unroll
    for (int it = 0; it < kItems; ++it) cur[it] = next[it];
    if (row + gridDim.x < rows) load_row<T, V, kItems>(next, x + (row + gridDim.x) * cols, vecs);
    float sq = 0.f;
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      if (threadIdx.x + static_cast<int64_t>(it) * blockDim.x < vecs) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float f = to_float(cur[it].v[k]);
          sq += f * f;
        }
      }
    }
    const float inv = rsqrtf(block_sum(sq, scratch) / static_cast<float>(cols) + epsilon);
    if (threadIdx.x == 0) rstd[row] = inv;
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(it) * blockDim.x;
      if (i < vecs) {
        Vec<T, V> ov;
#pragma unroll
        for (int k = 0; k < V; ++k)
          ov.v[k] = from_float<T>(round_to_storage<T>(to_float(cur[it].v[k]) * inv) * to_float(w[it].v[k]));
        store_vec<V>(out + row * cols + i * V, ov);
      }
    }
  }
}

// Vectors each thread holds in the cached kernel (a build-time knob so that the GPU benchmark can
// sweep it: benchmarks/gpu/bench_gpu.py --sections rms_sweep). H200, 8192 rows, bf16, fused
// add+norm forward as a fraction of copy bandwidth at hidden 4096/5120/8192: 1 -> 91/81/95%,
// 2 -> 92/93/95%, 4 -> 83/84/86%, 8 -> 70/68/73% (benchmarks/results/gpu_h200_run3_sweep.json,
// repeated in gpu_h200_rms_norm_sweep.json, at commit 8c5140e). The plain norm reaches 67-73% at every setting while
// Liger's reaches 70-90%: its time is per-row fixed cost (launch, barriers, reduction), not bytes.
#ifndef FASTFFN_RMS_NORM_VECS_PER_THREAD
#define FASTFFN_RMS_NORM_VECS_PER_THREAD 2
#endif


// Threads for the cached kernel: FASTFFN_RMS_NORM_VECS_PER_THREAD vectors each, 32..512 threads.
int cached_threads(int64_t vecs) {
  constexpr int64_t per_thread = FASTFFN_RMS_NORM_VECS_PER_THREAD;
  int64_t t = (vecs + per_thread - 1) / per_thread;
  t = (t + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > kMaxCachedThreads ? kMaxCachedThreads : t));
}

template <typename Fn>
fastffn_status items_switch(int64_t items, Fn&& fn) {
  if (items <= 1) return fn(std::integral_constant<int, 1>{});
  if (items <= 2) return fn(std::integral_constant<int, 2>{});
  if (items <= 4) return fn(std::integral_constant<int, 4>{});
  return fn(std::integral_constant<int, 8>{});
}

template <typename T, int V, bool kResidual>
__global__ void rms_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                                    const T* __restrict__ weight, T* __restrict__ out,
                                    T* __restrict__ sum_out, float* __restrict__ rstd,
                                    int64_t rows, int64_t cols, float epsilon) {
  __shared__ float scratch[32];
  const int64_t vecs = cols / V;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    T* sr = kResidual ? sum_out + row * cols : nullptr;
    float sq = 0.f;
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      Vec<T, V> xv = load_vec<V>(xr + i * V);
      if constexpr (kResidual) {
        const Vec<T, V> rv = load_vec<V>(residual + row * cols + i * V);
#pragma unroll
        for (int k = 0; k < V; ++k) xv.v[k] = from_float<T>(to_float(xv.v[k]) + to_float(rv.v[k]));
        store_vec<V>(sr + i * V, xv);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float f = to_float(xv.v[k]);
        sq += f * f;
      }
    }
    const float inv = rsqrtf(block_sum(sq, scratch) / static_cast<float>(cols) + epsilon);
    if (threadIdx.x == 0) rstd[row] = inv;
    // Each thread re-reads exactly the elements it wrote to sum_out: no barrier needed.
    const T* src = kResidual ? sr : xr;
    T* o = out + row * cols;
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      const Vec<T, V> xv = load_vec<V>(src + i * V);
      const Vec<T, V> wv = load_vec<V>(weight + i * V);
      Vec<T, V> ov;
#pragma unroll
      for (int k = 0; k < V; ++k)
        ov.v[k] = from_float<T>(round_to_storage<T>(to_float(xv.v[k]) * inv) * to_float(wv.v[k]));
      store_vec<V>(o + i * V, ov);
    }
  }
}

// d_x = rstd * (g - n * mean(g * n)) + d_sum with n = x * rstd, g = d_out * weight;
// d_weight partial (this block's rows) = sum d_out * round(n). Each thread owns its columns, so
// the partials need no atomics. kSharedPartials: they live in shared memory, laid out [V][vecs]
// (consecutive threads, consecutive banks) and are copied out at the end; otherwise (rows wider
// than the device's shared memory) they accumulate in place in this block's workspace row.
template <typename T, int V, bool kDSum, bool kSharedPartials>
__global__ void rms_norm_bwd_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                    const float* __restrict__ rstd, const T* __restrict__ d_out,
                                    const T* __restrict__ d_sum, T* __restrict__ d_x,
                                    float* __restrict__ d_weight_partial, int64_t rows,
                                    int64_t cols) {
  extern __shared__ float shared_partials[];
  __shared__ float scratch[32];
  const int64_t vecs = cols / V;
  float* partial = d_weight_partial + blockIdx.x * cols;
  auto d_weight_acc = [&](int64_t i, int k) -> float& {
    return kSharedPartials ? shared_partials[k * vecs + i] : partial[i * V + k];
  };
  for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x)
#pragma unroll
    for (int k = 0; k < V; ++k) d_weight_acc(i, k) = 0.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    const T* dyr = d_out + row * cols;
    const float inv = rstd[row];
    float dot = 0.f;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      const Vec<T, V> xv = load_vec<V>(xr + i * V);
      const Vec<T, V> dv = load_vec<V>(dyr + i * V);
      const Vec<T, V> wv = load_vec<V>(weight + i * V);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float n = to_float(xv.v[k]) * inv;
        const float dy = to_float(dv.v[k]);
        dot += dy * to_float(wv.v[k]) * n;
        d_weight_acc(i, k) += dy * round_to_storage<T>(n);
      }
    }
    const float mean_dot = block_sum(dot, scratch) / static_cast<float>(cols);
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      const Vec<T, V> xv = load_vec<V>(xr + i * V);
      const Vec<T, V> dv = load_vec<V>(dyr + i * V);
      const Vec<T, V> wv = load_vec<V>(weight + i * V);
      Vec<T, V> sv;
      if constexpr (kDSum) sv = load_vec<V>(d_sum + row * cols + i * V);
      Vec<T, V> dxv;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float n = to_float(xv.v[k]) * inv;
        float g = inv * (to_float(dv.v[k]) * to_float(wv.v[k]) - n * mean_dot);
        if constexpr (kDSum) g += to_float(sv.v[k]);
        dxv.v[k] = from_float<T>(g);
      }
      store_vec<V>(d_x + row * cols + i * V, dxv);
    }
  }
  if constexpr (kSharedPartials)
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x)
#pragma unroll
      for (int k = 0; k < V; ++k) partial[i * V + k] = d_weight_acc(i, k);
}

// d_weight[c] = sum over blocks of partial[b][c]: 32 columns x 8 block-lanes per CUDA block.
template <typename T>
__global__ void reduce_partials_kernel(const float* __restrict__ partial, T* __restrict__ d_weight,
                                       int64_t blocks, int64_t cols) {
  __shared__ float tile[8][33];
  const int64_t c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < cols)
    for (int64_t b = threadIdx.y; b < blocks; b += 8) acc += partial[b * cols + c];
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
#pragma unroll
    for (int j = 1; j < 8; ++j) acc += tile[j][threadIdx.x];
    d_weight[c] = from_float<T>(acc);
  }
}

template <typename T>
bool can_vectorize(int64_t cols, std::initializer_list<const void*> ptrs) {
  if (cols % kVecWidth<T> != 0) return false;
  for (const void* p : ptrs)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

fastffn_status bwd_plan(const fastffn_rms_norm_args& a, fastffn_rms_norm_bwd_plan* plan) {
  fastffn_device_limits limits;
  const fastffn_status status = current_device_limits(&limits);
  if (status == FASTFFN_STATUS_OK) *plan = fastffn_plan_rms_norm_bwd(a.rows, a.cols, limits);
  return status;
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;

extern "C" fastffn_status fastffn_rms_norm_fwd_cuda(fastffn_rms_norm_args a, const void* x,
                                                    const void* residual, const void* weight,
                                                    void* out, void* sum_out, float* rstd,
                                                    void* stream) {
  FASTFFN_TRY_STATUS(
      fastffn::check_rms_norm_fwd(__func__, a, x, residual, weight, out, sum_out, rstd, false));
  if (a.rows == 0) return FASTFFN_STATUS_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = can_vectorize<T>(a.cols, {x, residual, weight, out, sum_out});
    return FASTFFN_BOOL_SWITCH(vec, kVector, [&] {
      return FASTFFN_BOOL_SWITCH(residual != nullptr, kResidual, [&] {
        constexpr int V = kVector ? kVecWidth<T> : 1;
        const unsigned int grid = static_cast<unsigned int>(a.rows < kMaxRowBlocks ? a.rows : kMaxRowBlocks);
        const int64_t vecs = a.cols / V;
        const int threads = cached_threads(vecs);
        const int64_t items = (vecs + threads - 1) / threads;
        if (!kResidual && items <= kMaxPrefetchItems) {
          fastffn_device_limits limits;
          if (const fastffn_status status = current_device_limits(&limits); status != FASTFFN_STATUS_OK)
            return status;
          return items_switch(items, [&](auto items_tag) {
            constexpr int kItems = decltype(items_tag)::value < kMaxPrefetchItems ? decltype(items_tag)::value
                                                                                  : kMaxPrefetchItems;
            auto kernel = rms_norm_fwd_prefetch_kernel<T, V, kItems>;
            const auto blocks =
                static_cast<unsigned int>(persistent_blocks(kernel, a.rows, threads, limits.sm_count));
            kernel<<<blocks, threads, 0, s>>>(static_cast<const T*>(x), static_cast<const T*>(weight),
                                               static_cast<T*>(out), rstd, a.rows, a.cols, a.epsilon);
            return launch_status();
          });
        }
        if (items <= kMaxCachedItems) {
          return items_switch(items, [&](auto items_tag) {
            constexpr int kItems = decltype(items_tag)::value;
            rms_norm_fwd_cached_kernel<T, V, kItems, kResidual><<<grid, threads, 0, s>>>(
                static_cast<const T*>(x), static_cast<const T*>(residual),
                static_cast<const T*>(weight), static_cast<T*>(out), static_cast<T*>(sum_out),
                rstd, a.rows, a.cols, a.epsilon);
            return launch_status();
          });
        }
        rms_norm_fwd_kernel<T, V, kResidual><<<grid, threads_for(a.cols / V), 0, s>>>(
            static_cast<const T*>(x), static_cast<const T*>(residual),
            static_cast<const T*>(weight), static_cast<T*>(out), static_cast<T*>(sum_out), rstd,
            a.rows, a.cols, a.epsilon);
        return launch_status();
      });
    });
  });
}

extern "C" int64_t fastffn_rms_norm_bwd_workspace_bytes_cuda(fastffn_rms_norm_args a) {
  fastffn_rms_norm_bwd_plan plan;
  return bwd_plan(a, &plan) == FASTFFN_STATUS_OK ? plan.workspace_bytes : -1;
}

extern "C" fastffn_status fastffn_rms_norm_bwd_cuda(fastffn_rms_norm_args a, const void* x,
                                                    const void* weight, const float* rstd,
                                                    const void* d_out, const void* d_sum,
                                                    void* d_x, void* d_weight, void* workspace,
                                                    void* stream) {
  FASTFFN_TRY_STATUS(
      fastffn::check_rms_norm_bwd(__func__, a, x, weight, rstd, d_out, d_x, d_weight, false));
  FASTFFN_CHECK_ARG(workspace != nullptr, __func__,
                    "workspace must not be NULL (fastffn_rms_norm_bwd_workspace_bytes_cuda bytes)");
  fastffn_rms_norm_bwd_plan plan;
  if (const fastffn_status status = bwd_plan(a, &plan); status != FASTFFN_STATUS_OK) return status;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = can_vectorize<T>(a.cols, {x, weight, d_out, d_sum, d_x});
    float* partial = static_cast<float*>(workspace);
    const fastffn_status status = FASTFFN_BOOL_SWITCH(vec, kVector, [&] {
      return FASTFFN_BOOL_SWITCH(d_sum != nullptr, kDSum, [&] {
        constexpr int V = kVector ? kVecWidth<T> : 1;
        return FASTFFN_BOOL_SWITCH(plan.shared_partials != 0, kSharedPartials, [&] {
          auto kernel = rms_norm_bwd_kernel<T, V, kDSum, kSharedPartials>;
          if (plan.shared_bytes > 48 * 1024)
            FASTFFN_TRY_STATUS(cuda_status(
                cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(plan.shared_bytes)),
                "fastffn_rms_norm_bwd_cuda", "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)"));
          if (a.rows > 0)
            kernel<<<static_cast<unsigned int>(plan.blocks), threads_for(a.cols / V),
                     plan.shared_bytes, s>>>(
                static_cast<const T*>(x), static_cast<const T*>(weight), rstd,
                static_cast<const T*>(d_out), static_cast<const T*>(d_sum), static_cast<T*>(d_x),
                partial, a.rows, a.cols);
          return launch_status();
        });
      });
    });
    if (status != FASTFFN_STATUS_OK) return status;
    if (a.rows == 0) {  // no rows: the weight gradient is zero
      return cuda_status(cudaMemsetAsync(d_weight, 0, a.cols * sizeof(T), s),
                         "fastffn_rms_norm_bwd_cuda", "cudaMemsetAsync(d_weight)");
    }
    reduce_partials_kernel<T><<<static_cast<unsigned int>((a.cols + 31) / 32), dim3(32, 8), 0, s>>>(
        partial, static_cast<T*>(d_weight), plan.blocks, a.cols);
    return launch_status();
  });
}
