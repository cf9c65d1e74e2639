// SwiGLU forward and backward on CUDA: out = silu(gate) * up, fp32 math, 16-byte vector loads
// and stores when the rows allow (cols and row strides multiples of 16 bytes, aligned bases),
// scalar otherwise. A 2-D grid (vector columns x rows) avoids per-element index division.
#include "cuda_common.cuh"
#include "../validate.h"

namespace fastffn {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridRows = 65535;

// __fdividef (x * approximate reciprocal, ~2 ulp): IEEE division's slow-path subroutine gave the
// fp32 kernels a stack frame and spills (ptxas, sm_80). For x << 0, __expf(-x) = inf and
// 1/inf = 0, so sigmoid saturates to 0 as it must; NaN propagates.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
swiglu_fwd_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                  int64_t rows, int64_t cols, int64_t gate_stride, int64_t up_stride,
                  int64_t out_stride) {
  const int64_t vecs = cols / V;
  const int64_t col_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* g = gate + row * gate_stride;
    const T* u = up + row * up_stride;
    T* o = out + row * out_stride;
    // Not unrolled: the grid covers a row's vectors in about one pass, and ptxas's unrolled fp32
    // variant spilled 4 bytes on sm_80 (nvcc 13.0, tests/build checks for spills).
#pragma unroll 1
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vecs;
         i += col_step) {
      const Vec<T, V> gv = load_vec<V>(g + i * V);
      const Vec<T, V> uv = load_vec<V>(u + i * V);
      Vec<T, V> ov;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float x = to_float(gv.v[k]);
        ov.v[k] = from_float<T>(x * sigmoid(x) * to_float(uv.v[k]));
      }
      store_vec<V>(o + i * V, ov);
    }
  }
}

// No __restrict__: the C API allows the backward in place (d_gate over gate, d_up over up,
// recomputed over d_out). Each element is read before the same thread writes it.
template <typename T, int V, bool kRecompute>
__global__ void __launch_bounds__(kThreads)
swiglu_bwd_kernel(const T* gate, const T* up, const T* d_out, T* d_gate, T* d_up, T* recomputed, int64_t rows, int64_t cols, int64_t gate_stride,
                  int64_t up_stride, int64_t d_out_stride, int64_t d_gate_stride,
                  int64_t d_up_stride, int64_t recomputed_stride) {
  const int64_t vecs = cols / V;
  const int64_t col_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vecs;
         i += col_step) {
      const Vec<T, V> gv = load_vec<V>(gate + row * gate_stride + i * V);
      const Vec<T, V> uv = load_vec<V>(up + row * up_stride + i * V);
      const Vec<T, V> dv = load_vec<V>(d_out + row * d_out_stride + i * V);
      Vec<T, V> dg, du, h;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float x = to_float(gv.v[k]);
        const float u = to_float(uv.v[k]);
        const float dy = to_float(dv.v[k]);
        const float sig = sigmoid(x);
        const float silu = x * sig;
        // d silu(x)/dx = sig * (1 + x * (1 - sig))
        dg.v[k] = from_float<T>(dy * u * sig * (1.f + x * (1.f - sig)));
        du.v[k] = from_float<T>(dy * silu);
        if constexpr (kRecompute) h.v[k] = from_float<T>(silu * u);
      }
      store_vec<V>(d_gate + row * d_gate_stride + i * V, dg);
      store_vec<V>(d_up + row * d_up_stride + i * V, du);
      if constexpr (kRecompute) store_vec<V>(recomputed + row * recomputed_stride + i * V, h);
    }
  }
}

dim3 grid_for(int64_t rows, int64_t vecs) {
  return dim3(blocks_for(vecs, kThreads, 1 << 16),
              static_cast<unsigned int>(rows < kMaxGridRows ? (rows > 0 ? rows : 1) : kMaxGridRows));
}

// Vector width usable for every pointer and row stride involved (16 bytes, else 1 element).
template <typename T>
int vector_width(int64_t cols, std::initializer_list<std::pair<const void*, int64_t>> views) {
  if (cols % kVecWidth<T> != 0) return 1;
  for (const auto& view : views)
    if (view.first != nullptr && (!aligned16(view.first) || !stride_aligned16<T>(view.second)))
      return 1;
  return kVecWidth<T>;
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;

extern "C" fastffn_status fastffn_swiglu_fwd_cuda(fastffn_swiglu_args a, void* out,
                                                  int64_t out_row_stride, void* stream) {
  FASTFFN_TRY_STATUS(fastffn::check_swiglu_fwd(__func__, a, out, out_row_stride, false));
  if (a.rows == 0 || a.cols == 0) return FASTFFN_STATUS_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int v = vector_width<T>(a.cols, {{a.gate, a.gate_row_stride}, {a.up, a.up_row_stride},
                                           {out, out_row_stride}});
    const T* gate = static_cast<const T*>(a.gate);
    const T* up = static_cast<const T*>(a.up);
    T* o = static_cast<T*>(out);
    return FASTFFN_BOOL_SWITCH(v > 1, kVector, [&] {
      constexpr int V = kVector ? kVecWidth<T> : 1;
      swiglu_fwd_kernel<T, V><<<grid_for(a.rows, a.cols / V), kThreads, 0, s>>>(
          gate, up, o, a.rows, a.cols, a.gate_row_stride, a.up_row_stride, out_row_stride);
      return launch_status();
    });
  });
}

extern "C" fastffn_status fastffn_swiglu_bwd_cuda(fastffn_swiglu_args a, const void* d_out,
                                                  int64_t d_out_row_stride, void* d_gate,
                                                  int64_t d_gate_row_stride, void* d_up,
                                                  int64_t d_up_row_stride, void* recomputed_out,
                                                  int64_t recomputed_out_row_stride, void* stream) {
  FASTFFN_TRY_STATUS(fastffn::check_swiglu_bwd(__func__, a, d_out, d_out_row_stride, d_gate,
                                               d_gate_row_stride, d_up, d_up_row_stride,
                                               recomputed_out, recomputed_out_row_stride, false));
  if (a.rows == 0 || a.cols == 0) return FASTFFN_STATUS_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int v = vector_width<T>(
        a.cols, {{a.gate, a.gate_row_stride}, {a.up, a.up_row_stride}, {d_out, d_out_row_stride},
                 {d_gate, d_gate_row_stride}, {d_up, d_up_row_stride},
                 {recomputed_out, recomputed_out_row_stride}});
    return FASTFFN_BOOL_SWITCH(v > 1, kVector, [&] {
      return FASTFFN_BOOL_SWITCH(recomputed_out != nullptr, kRecompute, [&] {
        constexpr int V = kVector ? kVecWidth<T> : 1;
        swiglu_bwd_kernel<T, V, kRecompute><<<grid_for(a.rows, a.cols / V), kThreads, 0, s>>>(
            static_cast<const T*>(a.gate), static_cast<const T*>(a.up),
            static_cast<const T*>(d_out), static_cast<T*>(d_gate), static_cast<T*>(d_up),
            static_cast<T*>(recomputed_out), a.rows, a.cols, a.gate_row_stride, a.up_row_stride,
            d_out_row_stride, d_gate_row_stride, d_up_row_stride, recomputed_out_row_stride);
        return launch_status();
      });
    });
  });
}
