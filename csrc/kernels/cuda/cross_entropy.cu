// Cross-entropy fused with its gradient on CUDA: one block per row of logits (grid-stride over
// rows), two passes over the row. The first reads it once with 16-byte vectors and keeps an online
// (max, sum of exponentials) pair per thread, rescaled once per group of vectors; the block merges
// the pairs. The second reads the row again and writes (softmax - onehot) * grad_scale over it. A
// row of 128256 bf16 logits (LLaMA-3) is 250 KiB, more than a block's registers or shared memory
// could hold, so the second read comes from L2 where it can. fp32 math for fp32/fp16/bf16 logits.
#include <cmath>

#include "cuda_common.cuh"

namespace fastffn {
namespace cuda {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kUnroll = 4;  // vectors per thread in flight per step of the first pass
constexpr int64_t kMaxRowBlocks = int64_t(1) << 30;

struct MaxSum {
  float m;  // running max (-inf before any finite value)
  float s;  // sum of exp(x - m)
};

// Merges two (max, sum) pairs. A side whose max is -inf holds no mass (exp of it is 0), which the
// guards keep from turning into exp(-inf - -inf) = NaN. NaN sums stay NaN.
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  const float sa = a.m == -INFINITY ? 0.f * a.s : a.s * __expf(a.m - m);
  const float sb = b.m == -INFINITY ? 0.f * b.s : b.s * __expf(b.m - m);
  return {m, sa + sb};
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)};
    v = merge(v, other);
  }
  return v;
}

// The row's (max, sum) on every thread of the block.
__device__ __forceinline__ MaxSum block_merge(MaxSum v, float* scratch_m, float* scratch_s) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_merge(v);
  __syncthreads();  // the scratch may still be read for the previous row
  if (lane == 0) {
    scratch_m[warp] = v.m;
    scratch_s[warp] = v.s;
  }
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  MaxSum w = lane < warps ? MaxSum{scratch_m[lane], scratch_s[lane]} : MaxSum{-INFINITY, 0.f};
  return warp_merge(w);
}

// Adds the first n of the kUnroll vectors to the pair with one rescale (NaN values are skipped by
// the max and reach the sum; -inf values add 0). The vectors stay in their storage type until
// used: converting them to fp32 up front doubled the registers of the bf16 variant and spilled.
template <int N, typename T, int V>
__device__ __forceinline__ void accumulate(MaxSum& acc, const Vec<T, V> (&xv)[N], int n) {
  float m = acc.m;
#pragma unroll
  for (int u = 0; u < N; ++u)
    if (u < n) {
#pragma unroll
      for (int k = 0; k < V; ++k) m = fmaxf(m, to_float(xv[u].v[k]));
    }
  if (m == -INFINITY) return;  // nothing but -inf (or NaN with no finite value) so far
  float s = acc.m == -INFINITY ? 0.f * acc.s : acc.s * __expf(acc.m - m);
#pragma unroll
  for (int u = 0; u < N; ++u)
    if (u < n) {
#pragma unroll
      for (int k = 0; k < V; ++k) s += __expf(to_float(xv[u].v[k]) - m);
    }
  acc = {m, s};
}

template <typename T>
__device__ __forceinline__ void fill_row(T* x, int64_t vocab, float value) {
  const T v = from_float<T>(value);
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) x[j] = v;
}

// V: elements per vector (16 bytes, or 1 for rows that are not 16-byte aligned).
template <typename T, int V, bool kWithGrad>
__global__ void __launch_bounds__(kMaxThreads)
cross_entropy_kernel(T* __restrict__ logits, const int64_t* __restrict__ labels,
                     float* __restrict__ loss, int64_t rows, int64_t vocab, int64_t row_stride,
                     int64_t ignore_index, float grad_scale, int32_t* __restrict__ label_error) {
  __shared__ float scratch_m[32];
  __shared__ float scratch_s[32];
  __shared__ float row_shared[2];  // lse, and the row's loss
  const int64_t vecs = vocab / V;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    T* x = logits + row * row_stride;
    const int64_t y = labels[row];
    if (y == ignore_index) {
      if (threadIdx.x == 0) loss[row] = 0.f;
      if constexpr (kWithGrad) fill_row(x, vocab, 0.f);
      continue;
    }
    if (y < 0 || y >= vocab) {  // never read out of bounds: report, and poison the row
      if (threadIdx.x == 0) {
        loss[row] = __int_as_float(0x7fc00000);
        if (label_error != nullptr) *label_error = 1;
      }
      if constexpr (kWithGrad) fill_row(x, vocab, __int_as_float(0x7fc00000));
      continue;
    }
    // Pass 1: online max and sum, kUnroll vectors of loads in flight per step.
    MaxSum acc{-INFINITY, 0.f};
    for (int64_t base = threadIdx.x; base < vecs; base += static_cast<int64_t>(kUnroll) * blockDim.x) {
      Vec<T, V> xv[kUnroll];
      int n = 0;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
        if (i < vecs) {
          xv[u] = load_vec<V>(x + i * V);
          n = u + 1;
        }
      }
      accumulate(acc, xv, n);
    }
    for (int64_t j = vecs * V + threadIdx.x; j < vocab; j += blockDim.x) {  // tail of the row
      const Vec<T, 1> tail[1] = {Vec<T, 1>{{x[j]}}};
      accumulate(acc, tail, 1);
    }
    const MaxSum total = block_merge(acc, scratch_m, scratch_s);
    if (threadIdx.x == 0) {
      const float lse = total.m + __logf(total.s);
      const float row_loss = lse - to_float(x[y]);
      loss[row] = row_loss;
      row_shared[0] = lse;
      row_shared[1] = row_loss;
    }
    if constexpr (!kWithGrad) continue;
    __syncthreads();
    const float lse = row_shared[0];
    if (!(row_shared[1] > 0.f)) {  // exactly 0 or NaN: PaddleNLP's criterion drops the token
      fill_row(x, vocab, 0.f);
      continue;
    }
    // Pass 2: the gradient over the logits. Each thread rewrites the elements it reads, and the
    // label's element was read above before the barrier.
#pragma unroll 2
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      Vec<T, V> xv = load_vec<V>(x + i * V);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t j = i * V + k;
        const float p = __expf(to_float(xv.v[k]) - lse);
        xv.v[k] = from_float<T>((j == y ? p - 1.f : p) * grad_scale);
      }
      store_vec<V>(x + i * V, xv);
    }
    for (int64_t j = vecs * V + threadIdx.x; j < vocab; j += blockDim.x) {
      const float p = __expf(to_float(x[j]) - lse);
      x[j] = from_float<T>((j == y ? p - 1.f : p) * grad_scale);
    }
  }
}

int threads_for(int64_t vecs) {
  int64_t t = (vecs + 7) / 8;  // at least 8 vectors per thread before adding threads
  t = (t + 31) / 32 * 32;
  return static_cast<int>(t < 64 ? 64 : (t > kMaxThreads ? kMaxThreads : t));
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;

extern "C" fastffn_status fastffn_cross_entropy_cuda(fastffn_cross_entropy_args a, void* logits,
                                                     const int64_t* labels, float* loss,
                                                     void* stream) {
  FASTFFN_TRY_STATUS(fastffn::check_cross_entropy(__func__, a, logits, labels, loss, false));
  if (a.rows == 0) return FASTFFN_STATUS_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = kVecWidth<T>;
    const bool vec = aligned16(logits) && stride_aligned16<T>(a.row_stride);
    const unsigned int grid = static_cast<unsigned int>(a.rows < kMaxRowBlocks ? a.rows : kMaxRowBlocks);
    return FASTFFN_BOOL_SWITCH(vec, kVector, [&] {
      return FASTFFN_BOOL_SWITCH(a.with_grad != 0, kWithGrad, [&] {
        constexpr int V = kVector ? W : 1;
        const int threads = threads_for(a.vocab / V);
        cross_entropy_kernel<T, V, kWithGrad><<<grid, threads, 0, s>>>(
            static_cast<T*>(logits), labels, loss, a.rows, a.vocab, a.row_stride, a.ignore_index,
            a.grad_scale, a.label_error);
        return launch_status();
      });
    });
  });
}
