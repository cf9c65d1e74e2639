// FP8 quantisation (cast + optional transpose + amax, one pass) and dequantisation on CUDA; the
// contract (rounding, saturation, NaN/Inf) is in fastffn/scaled_tensor.h.
//
// Quantisation walks x in 128 x 128 tiles (fp8_common.cuh: conversion, the shared-memory
// transpose, the block amax, the load order: one segment ahead). Tiles are spread over a
// persistent grid sized from the device's SM count and the kernel's occupancy, so each block
// issues a single amax atomic. An amax-only pass over a contiguous x (current scaling's first
// pass) takes a flat kernel instead (amax_kernel).
#include "fp8_common.cuh"

namespace fastffn {
namespace cuda {
namespace {

constexpr int kThreads = kTileThreads;
constexpr int64_t kMaxGridRows = 65535;

template <typename T>
struct QuantizeParams {
  const T* x;
  uint8_t* out;    // [rows, cols] or NULL
  uint8_t* out_t;  // [cols, rows] or NULL
  int64_t rows, cols, x_stride, out_stride, out_t_stride;
  int64_t col_tiles, tiles;
  const float* scale;
  float* scale_inv;
  unsigned int* amax;  // the fp32 amax as bits (non-negative floats order as unsigned ints)
  bool vec_x, vec_out, vec_out_t;
};

template <typename T, __nv_fp8_interpretation_t F, bool kTranspose>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const QuantizeParams<T> p) {
  __shared__ uint4 tile[kTranspose ? kTile * kSegsPerRow : 1];  // FP8 bytes of one input tile
  __shared__ uint32_t warp_amax[kThreads / 32];
  const float scale = p.scale != nullptr ? *p.scale : 1.f;
  const bool scale_finite = abs_bits(scale) < kInfBits;
  if (p.scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    *p.scale_inv = __frcp_rn(scale);  // IEEE reciprocal, unaffected by --use_fast_math
  const bool convert = p.out != nullptr || kTranspose;
  uint32_t amax = 0;

  // One segment ahead, across tiles (fp8_common.cuh: load order): the next segment of x (the next
  // tile's first after a tile's last) is loaded, packed, before this segment's stores (sm_80:
  // after, kLoadAhead).
  PackedSeg<T> x, next_x;
  auto load = [&](int64_t r0, int64_t c0, int i, PackedSeg<T>& dst) {
    const TileSeg s = tile_seg(r0, c0, i, p.rows, p.cols);
    if (s.valid == 0) return false;
    dst.load(p.x + s.r * p.x_stride + s.c, s.valid, p.vec_x);
    return true;
  };
  int64_t r0 = blockIdx.x / p.col_tiles * kTile, c0 = blockIdx.x % p.col_tiles * kTile;
  bool in = blockIdx.x < p.tiles && load(r0, c0, 0, x);
  for (int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const int64_t next_t = t + gridDim.x;
    const int64_t next_r0 = next_t / p.col_tiles * kTile, next_c0 = next_t % p.col_tiles * kTile;
#pragma unroll 1
    for (int i = 0; i < kSegsPerThread; ++i) {
      const bool last = i + 1 == kSegsPerThread;
      auto load_next = [&] {
        return last ? next_t < p.tiles && load(next_r0, next_c0, 0, next_x) : load(r0, c0, i + 1, next_x);
      };
      bool next_in = false;
      if constexpr (kLoadAhead) next_in = load_next();
      if (in) {
        const TileSeg s = tile_seg(r0, c0, i, p.rows, p.cols);
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // four values at a time: few fp32 values live
          float v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) v[e] = x.get(4 * k + e);  // zeros past the matrix
          const uint32_t bits = amax_bits4(v);
          amax = max(amax, bits);
          if (convert) w[k] = quantize4<F>(v, scale, bits >= kInfBits || !scale_finite);
        }
        if (convert) {
          const uint4 q = make_uint4(w[0], w[1], w[2], w[3]);
          if (p.out != nullptr) store16(p.out + s.r * p.out_stride + s.c, q, s.valid, p.vec_out);
          if constexpr (kTranspose) tile[tile_slot(s.row, s.seg)] = q;
        }
      }
      if constexpr (!kLoadAhead) next_in = load_next();
      x = next_x;
      in = next_in;
    }
    if constexpr (kTranspose) {
      __syncthreads();
      store_tile_transposed(tile, r0, c0, p.rows, p.cols, p.out_t, p.out_t_stride, p.vec_out_t);
      __syncthreads();  // the next tile overwrites `tile`
    }
    r0 = next_r0;
    c0 = next_c0;
  }

  if (p.amax != nullptr) block_amax_to(p.amax, amax, warp_amax);
}

// The amax-only pass of current scaling over a contiguous x: no copy is written, so nothing needs
// tiles; a flat grid-stride loop with kAmaxSegs 16-element segments per thread and iteration (all
// loads issued before the max). Measured only a little faster than the tile walk (H200, 8192 x 4096
// bf16: 26-27 us, 61-64% of copy bandwidth; about 9 us per call does not scale with size,
// benchmarks/results/run12/fp8_ffn.json at commit 8c5140e). Row-strided views keep the tile kernel.
constexpr int kAmaxSegs = 2;

template <typename T>
__global__ void __launch_bounds__(kThreads)
amax_kernel(const T* __restrict__ x, int64_t n, bool vec, const float* scale, float* scale_inv,
            unsigned int* amax) {
  __shared__ uint32_t warp_amax[kThreads / 32];
  if (scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    *scale_inv = __frcp_rn(scale != nullptr ? *scale : 1.f);  // as quantize_kernel writes it
  const int64_t segs = (n + kSeg - 1) / kSeg;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads * kAmaxSegs;
  uint32_t m = 0;
  for (int64_t first = blockIdx.x * static_cast<int64_t>(kThreads) * kAmaxSegs + threadIdx.x;
       first < segs; first += step) {
    float v[kAmaxSegs][kSeg];
#pragma unroll
    for (int k = 0; k < kAmaxSegs; ++k) {
      const int64_t seg = first + static_cast<int64_t>(k) * kThreads;
      const int64_t c = seg * kSeg;
      const int valid = seg >= segs ? 0 : (n - c < kSeg ? static_cast<int>(n - c) : kSeg);
      if (valid > 0) {
        load16(x + c, valid, vec, v[k]);
      } else {
#pragma unroll
        for (int j = 0; j < kSeg; ++j) v[k][j] = 0.f;
      }
    }
#pragma unroll
    for (int k = 0; k < kAmaxSegs; ++k) m = max(m, amax_bits16(v[k]));
  }
  if (amax != nullptr) block_amax_to(amax, m, warp_amax);
}

// The byte-for-byte transpose of an FP8 x [rows, cols] into out_t [cols, rows]: a stored FP8 copy's
// other layout (a frozen weight's dgrad copy from its forward copy), with quantize_kernel's tile walk
// and shared-memory transpose but no conversion. A thread issues its four 16-byte segment loads of
// a tile before it parks any of them, so each block keeps a whole tile of loads in flight.
__device__ __forceinline__ uint4 load16_bytes(const uint8_t* p, int valid, bool vec) {
  if (vec && valid == kSeg) return *reinterpret_cast<const uint4*>(p);
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < kSeg; ++j)
    if (j < valid) w[j / 4] |= static_cast<uint32_t>(p[j]) << (8 * (j % 4));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

struct TransposeParams {
  const uint8_t* x;
  uint8_t* out_t;
  int64_t rows, cols, x_stride, out_t_stride, col_tiles, tiles;
  bool vec_x, vec_out_t;
};

__global__ void __launch_bounds__(kThreads) transpose_fp8_kernel(const TransposeParams p) {
  __shared__ uint4 tile[kTile * kSegsPerRow];
  for (int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const int64_t r0 = t / p.col_tiles * kTile, c0 = t % p.col_tiles * kTile;
    uint4 q[kSegsPerThread];
#pragma unroll
    for (int i = 0; i < kSegsPerThread; ++i) {
      const TileSeg s = tile_seg(r0, c0, i, p.rows, p.cols);
      q[i] = s.valid > 0 ? load16_bytes(p.x + s.r * p.x_stride + s.c, s.valid, p.vec_x) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kSegsPerThread; ++i) {
      const TileSeg s = tile_seg(r0, c0, i, p.rows, p.cols);
      tile[tile_slot(s.row, s.seg)] = q[i];
    }
    __syncthreads();
    store_tile_transposed(tile, r0, c0, p.rows, p.cols, p.out_t, p.out_t_stride, p.vec_out_t);
    __syncthreads();  // the next tile overwrites `tile`
  }
}

template <typename T, __nv_fp8_interpretation_t F>
__global__ void __launch_bounds__(kThreads)
dequantize_kernel(const uint8_t* __restrict__ q, T* __restrict__ y, int64_t rows, int64_t cols,
                  int64_t q_stride, int64_t y_stride, const float* scale_inv, bool vec) {
  const float s = scale_inv != nullptr ? *scale_inv : 1.f;
  const int64_t segs = (cols + kSeg - 1) / kSeg;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < segs;
         i += step) {
      const int64_t c = i * kSeg;
      const int valid = cols - c < kSeg ? static_cast<int>(cols - c) : kSeg;
      const uint8_t* src = q + r * q_stride + c;
      uint32_t w[4] = {0, 0, 0, 0};
      if (vec && valid == kSeg) {
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
      } else {
#pragma unroll
        for (int j = 0; j < kSeg; ++j)
          if (j < valid) w[j / 4] |= static_cast<uint32_t>(src[j]) << (8 * (j % 4));
      }
      float v[kSeg];
#pragma unroll
      for (int k = 0; k < kSeg / 2; ++k) {  // FP8 -> fp16 is exact (both formats fit in fp16)
        const auto pair = static_cast<__nv_fp8x2_storage_t>(w[k / 2] >> (16 * (k % 2)));
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, F)));
        v[2 * k] = f.x * s;
        v[2 * k + 1] = f.y * s;
      }
      T* dst = y + r * y_stride + c;
      if (vec && valid == kSeg) {
        constexpr int V = kVecWidth<T>;
#pragma unroll
        for (int j = 0; j < kSeg; j += V) {
          Vec<T, V> out;
#pragma unroll
          for (int e = 0; e < V; ++e) out.v[e] = from_float<T>(v[j + e]);
          store_vec<V>(dst + j, out);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kSeg; ++j)
          if (j < valid) dst[j] = from_float<T>(v[j]);
      }
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;

namespace {

// fastffn_fp8_quantize_cuda for an FP8 x: the transposed copy of its bytes (scaled_tensor.h).
fastffn_status transpose_fp8(const char* entry, fastffn_tensor x, fastffn_tensor out, fastffn_tensor out_t,
                             int sm_count, cudaStream_t stream) {
  FASTFFN_CHECK_ARG(out.data == nullptr && out.scale == nullptr && out.scale_inv == nullptr && out.amax == nullptr,
                    entry, "an FP8 x (%s) is transposed byte for byte into out_t: out.data, out.scale, "
                    "out.scale_inv and out.amax must be NULL", ::fastffn::dtype_name(x.dtype));
  FASTFFN_CHECK(out_t.dtype == x.dtype, FASTFFN_STATUS_INVALID_ARGUMENT, entry,
                "out_t.dtype (%s) must be x.dtype (%s) when x is FP8", ::fastffn::dtype_name(out_t.dtype),
                ::fastffn::dtype_name(x.dtype));
  FASTFFN_CHECK_ARG(out_t.data != nullptr || x.rows == 0 || x.cols == 0, entry,
                    "out_t.data must not be NULL when x is FP8 (its transposed copy is the only output)");
  FASTFFN_TRY_STATUS(check_shaped(entry, "out_t", out_t, x.cols, x.rows));
  if (x.rows == 0 || x.cols == 0) return ::fastffn::ok();
  // Blocks read x while others write out_t: overlapping storage would race.
  const char* x_first = static_cast<const char*>(x.data);
  const char* x_end = x_first + (x.rows - 1) * x.row_stride + x.cols;
  const char* out_first = static_cast<const char*>(out_t.data);
  const char* out_end = out_first + (out_t.rows - 1) * out_t.row_stride + out_t.cols;
  FASTFFN_CHECK_ARG(out_end <= x_first || x_end <= out_first, entry,
                    "out_t must not overlap x (the transpose reads x while it writes out_t)");
  TransposeParams p;
  p.x = static_cast<const uint8_t*>(x.data);
  p.out_t = static_cast<uint8_t*>(out_t.data);
  p.rows = x.rows;
  p.cols = x.cols;
  p.x_stride = x.row_stride;
  p.out_t_stride = out_t.row_stride;
  p.col_tiles = (x.cols + kTile - 1) / kTile;
  p.tiles = (x.rows + kTile - 1) / kTile * p.col_tiles;
  p.vec_x = bytes_aligned16(x.data, x.row_stride);
  p.vec_out_t = bytes_aligned16(out_t.data, out_t.row_stride);
  const int64_t blocks = persistent_tile_blocks(transpose_fp8_kernel, p.tiles, sm_count);
  transpose_fp8_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(p);
  return launch_status();
}

}  // namespace

extern "C" fastffn_status fastffn_fp8_quantize_cuda(fastffn_tensor x, fastffn_tensor out,
                                                    fastffn_tensor out_t, void* stream) {
  const bool empty = x.rows == 0 || x.cols == 0;
  FASTFFN_CHECK_ARG(x.rows >= 0 && x.cols >= 0 && x.row_stride >= x.cols, __func__,
                    "x must have rows, cols >= 0 and row_stride >= cols, got [%lld, %lld] stride %lld",
                    (long long)x.rows, (long long)x.cols, (long long)x.row_stride);
  FASTFFN_CHECK_ARG(x.data != nullptr || empty, __func__, "x.data must not be NULL");
  if (x.dtype == FASTFFN_DTYPE_FP8_E4M3 || x.dtype == FASTFFN_DTYPE_FP8_E5M2) {
    fastffn_device_limits limits;
    const fastffn_status queried = current_device_limits(&limits);
    if (queried != FASTFFN_STATUS_OK) return queried;
    return transpose_fp8(__func__, x, out, out_t, limits.sm_count, static_cast<cudaStream_t>(stream));
  }
  FASTFFN_TRY_STATUS(::fastffn::check_storage_dtype(__func__, "x.dtype", x.dtype, false));
  FASTFFN_TRY_STATUS(check_fp8(__func__, "out.dtype", out.dtype));
  if (out.data != nullptr) FASTFFN_TRY_STATUS(check_shaped(__func__, "out", out, x.rows, x.cols));
  if (out_t.data != nullptr) {
    FASTFFN_CHECK(out_t.dtype == out.dtype, FASTFFN_STATUS_INVALID_ARGUMENT, __func__,
                  "out_t.dtype (%s) must be out.dtype (%s)", ::fastffn::dtype_name(out_t.dtype),
                  ::fastffn::dtype_name(out.dtype));
    FASTFFN_TRY_STATUS(check_shaped(__func__, "out_t", out_t, x.cols, x.rows));
  }
  FASTFFN_CHECK_ARG(!scaling_aliased(out), __func__,
                    "out.scale, out.scale_inv and out.amax must be distinct pointers");
  fastffn_device_limits limits;
  const fastffn_status queried = current_device_limits(&limits);
  if (queried != FASTFFN_STATUS_OK) return queried;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    QuantizeParams<T> p;
    p.x = static_cast<const T*>(x.data);
    p.out = static_cast<uint8_t*>(out.data);
    p.out_t = static_cast<uint8_t*>(out_t.data);
    p.rows = x.rows;
    p.cols = x.cols;
    p.x_stride = x.row_stride;
    p.out_stride = out.row_stride;
    p.out_t_stride = out_t.row_stride;
    // At least 1: every block divides by it for its first tile, even when there is none.
    p.col_tiles = x.cols == 0 ? 1 : (x.cols + kTile - 1) / kTile;
    p.tiles = empty ? 0 : (x.rows + kTile - 1) / kTile * p.col_tiles;
    p.scale = out.scale;
    p.scale_inv = out.scale_inv;
    p.amax = reinterpret_cast<unsigned int*>(out.amax);
    p.vec_x = aligned16(x.data) && stride_aligned16<T>(x.row_stride);
    p.vec_out = bytes_aligned16(out.data, out.row_stride);
    p.vec_out_t = bytes_aligned16(out_t.data, out_t.row_stride);
    if (out.data == nullptr && out_t.data == nullptr && x.row_stride == x.cols) {
      const int64_t n = empty ? 0 : x.rows * x.cols;  // empty: one block writes scale_inv
      auto kernel = amax_kernel<T>;
      const int64_t per_block = int64_t(kThreads) * kAmaxSegs * kSeg;
      const int64_t blocks = persistent_blocks(kernel, (n + per_block - 1) / per_block, kThreads,
                                               limits.sm_count);
      kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, s>>>(
          p.x, n, aligned16(x.data), p.scale, p.scale_inv, p.amax);
      return launch_status();
    }
    return FASTFFN_BOOL_SWITCH(out.dtype == FASTFFN_DTYPE_FP8_E5M2, kE5M2, [&] {
      constexpr __nv_fp8_interpretation_t F = kE5M2 ? __NV_E5M2 : __NV_E4M3;
      return FASTFFN_BOOL_SWITCH(out_t.data != nullptr, kTranspose, [&] {
        auto kernel = quantize_kernel<T, F, kTranspose>;
        const int64_t blocks = persistent_tile_blocks(kernel, p.tiles, limits.sm_count);
        kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, s>>>(p);
        return launch_status();
      });
    });
  });
}

extern "C" fastffn_status fastffn_fp8_dequantize_cuda(fastffn_tensor q, fastffn_tensor y,
                                                      void* stream) {
  FASTFFN_TRY_STATUS(check_fp8(__func__, "q.dtype", q.dtype));
  FASTFFN_CHECK_ARG(q.rows >= 0 && q.cols >= 0 && q.row_stride >= q.cols, __func__,
                    "q must have rows, cols >= 0 and row_stride >= cols, got [%lld, %lld] stride %lld",
                    (long long)q.rows, (long long)q.cols, (long long)q.row_stride);
  FASTFFN_TRY_STATUS(check_shaped(__func__, "y", y, q.rows, q.cols));
  FASTFFN_TRY_STATUS(::fastffn::check_storage_dtype(__func__, "y.dtype", y.dtype, false));
  if (q.rows == 0 || q.cols == 0) return ::fastffn::ok();
  FASTFFN_CHECK_ARG(q.data != nullptr && y.data != nullptr, __func__,
                    "q.data and y.data must not be NULL");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(y.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = bytes_aligned16(q.data, q.row_stride) && aligned16(y.data) &&
                     stride_aligned16<T>(y.row_stride);
    const int64_t segs = (q.cols + kSeg - 1) / kSeg;
    const dim3 grid(blocks_for(segs, kThreads, 65535),
                    static_cast<unsigned int>(q.rows < kMaxGridRows ? q.rows : kMaxGridRows));
    return FASTFFN_BOOL_SWITCH(q.dtype == FASTFFN_DTYPE_FP8_E5M2, kE5M2, [&] {
      constexpr __nv_fp8_interpretation_t F = kE5M2 ? __NV_E5M2 : __NV_E4M3;
      dequantize_kernel<T, F><<<grid, kThreads, 0, s>>>(
          static_cast<const uint8_t*>(q.data), static_cast<T*>(y.data), q.rows, q.cols,
          q.row_stride, y.row_stride, q.scale_inv, vec);
      return launch_status();
    });
  });
}
