// FP8 quantisation (cast + optional transpose + amax, one pass) and dequantisation on CUDA; the
// contract (rounding, saturation, NaN/Inf) is in fastffn/scaled_tensor.h.
//
// Quantisation walks x in 128 x 128 tiles. A thread converts 16 consecutive elements of a row
// (16-byte loads) into 16 FP8 bytes, stores them row-wise with one 16-byte store and parks them in
// shared memory. After a barrier each thread gathers 16 rows x 4 columns of bytes (a warp reads one
// 128-byte tile row per load: no bank conflicts), transposes them with byte permutes and writes
// four 16-byte rows of the transposed copy. Tiles are spread over a persistent grid sized from the
// device's SM count and the kernel's occupancy, so each block issues a single amax atomic.
//
// amax is a max over the bit patterns of |x| as unsigned integers: for non-negative floats the
// integer order is the float order, every NaN pattern sorts above Inf (so a NaN wins), and neither
// flush-to-zero (--use_fast_math) nor fmaxf's NaN dropping can change it.
#include <cuda_fp8.h>

#include "cuda_common.cuh"
#include "fastffn/scaled_tensor.h"

namespace fastffn {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 128;                                      // input rows and columns per tile
constexpr int kSeg = 16;                                        // elements per thread access
constexpr int kSegsPerRow = kTile / kSeg;                       // 8
constexpr int kSegsPerThread = kTile * kSegsPerRow / kThreads;  // 4
constexpr int kTileWords = kTile / 4;                           // 32-bit words per tile row
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kFp8NaN = 0x7fu;  // S.1111.111 is e4m3's NaN, S.11111.11 one of e5m2's
constexpr int64_t kMaxGridRows = 65535;

static_assert(kTile * kSegsPerRow % kThreads == 0, "whole segments per thread");
static_assert(kThreads / 32 * kSeg == kTile, "transpose phase: one warp per 16 tile rows");

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & kAbsMask; }

// Two values -> two FP8 bytes (lo in the low byte), round to nearest even, finite values saturate.
template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ uint32_t fp8x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, F);
}

// The byte for a value whose x or y = x * scale is not finite, or kKeep where the saturating
// conversion is already right (finite x whose product overflowed: +-max). Inf stays Inf in e5m2
// and becomes NaN in e4m3 (which has no Inf); NaN becomes the canonical 0x7F.
constexpr uint32_t kKeep = 0x100u;

template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ uint32_t special_byte(float x, float y) {
  if (abs_bits(x) == kInfBits)
    return F == __NV_E5M2 ? (((__float_as_uint(x) >> 24) & 0x80u) | 0x7cu) : kFp8NaN;
  return abs_bits(y) > kInfBits ? kFp8NaN : kKeep;
}

// 16 values -> 16 FP8 bytes, little-endian in a uint4. `special`: some x or x * scale is not
// finite, so bytes are patched where the format's Inf/NaN rules differ from the saturating
// conversion (rare; the common path is eight paired conversions).
template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ uint4 quantize16(const float (&x)[kSeg], float scale, bool special) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float* v = x + 4 * k;
    w[k] = fp8x2<F>(v[0] * scale, v[1] * scale) | (fp8x2<F>(v[2] * scale, v[3] * scale) << 16);
  }
  if (special) {
#pragma unroll
    for (int j = 0; j < kSeg; ++j) {
      const uint32_t byte = special_byte<F>(x[j], x[j] * scale);
      const int shift = 8 * (j % 4);
      if (byte != kKeep) w[j / 4] = (w[j / 4] & ~(0xffu << shift)) | (byte << shift);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// `valid` (1..16) elements at p into x (zeros after them); 16-byte loads when `vec` and full.
template <typename T>
__device__ __forceinline__ void load16(const T* p, int valid, bool vec, float (&x)[kSeg]) {
  if (vec && valid == kSeg) {
    constexpr int V = kVecWidth<T>;
#pragma unroll
    for (int i = 0; i < kSeg; i += V) {
      const Vec<T, V> v = load_vec<V>(p + i);
#pragma unroll
      for (int j = 0; j < V; ++j) x[i + j] = to_float(v.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kSeg; ++j) x[j] = j < valid ? to_float(p[j]) : 0.f;
  }
}

// The first `valid` bytes of q to p: one 16-byte store when `vec` and full.
__device__ __forceinline__ void store16(uint8_t* p, const uint4& q, int valid, bool vec) {
  if (vec && valid == kSeg) {
    *reinterpret_cast<uint4*>(p) = q;
    return;
  }
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < kSeg; ++j)
    if (j < valid) p[j] = static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
}

// 4 x 4 byte transpose: out[j] holds byte j of in[0], in[1], in[2], in[3] (in that order).
__device__ __forceinline__ void transpose4x4(const uint32_t* in, uint32_t (&out)[4]) {
  const uint32_t lo01 = __byte_perm(in[0], in[1], 0x5140);  // in0.b0 in1.b0 in0.b1 in1.b1
  const uint32_t lo23 = __byte_perm(in[2], in[3], 0x5140);
  const uint32_t hi01 = __byte_perm(in[0], in[1], 0x7362);  // in0.b2 in1.b2 in0.b3 in1.b3
  const uint32_t hi23 = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

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

  for (int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const int64_t r0 = t / p.col_tiles * kTile;
    const int64_t c0 = t % p.col_tiles * kTile;
    // sm_80 has no FP8 conversion instructions (cuda_fp8.h emulates them, dozens of instructions
    // per value), so unrolling there only bloats code and registers; sm_89+ overlaps the 4 loads.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#pragma unroll
#else
#pragma unroll 1
#endif
    for (int i = 0; i < kSegsPerThread; ++i) {
      const int s = i * kThreads + threadIdx.x;
      const int row = s / kSegsPerRow, seg = s % kSegsPerRow;
      const int64_t r = r0 + row, c = c0 + seg * kSeg;
      if (r >= p.rows || c >= p.cols) continue;
      const int valid = p.cols - c < kSeg ? static_cast<int>(p.cols - c) : kSeg;
      float x[kSeg];
      load16(p.x + r * p.x_stride + c, valid, p.vec_x, x);
      uint32_t seg_amax = 0;
#pragma unroll
      for (int j = 0; j < kSeg; ++j) seg_amax = max(seg_amax, abs_bits(x[j]));
      amax = max(amax, seg_amax);
      if (!convert) continue;
      const uint4 q = quantize16<F>(x, scale, seg_amax >= kInfBits || !scale_finite);
      if (p.out != nullptr) store16(p.out + r * p.out_stride + c, q, valid, p.vec_out);
      if constexpr (kTranspose) tile[row * kSegsPerRow + seg] = q;
    }
    if constexpr (kTranspose) {
      __syncthreads();
      const int lane = threadIdx.x & 31;                 // input columns c0 + 4 lane .. + 3
      const int64_t r = r0 + (threadIdx.x >> 5) * kSeg;  // input rows r .. r + 15
      const int64_t c = c0 + 4 * lane;
      if (r < p.rows && c < p.cols) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(tile) +
                                (threadIdx.x >> 5) * kSeg * kTileWords + lane;
        uint32_t w[kSeg];
#pragma unroll
        for (int i = 0; i < kSeg; ++i) w[i] = words[i * kTileWords];
        uint32_t columns[4][4];  // [input column j][word k: input rows 4k .. 4k + 3]
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          uint32_t out[4];
          transpose4x4(w + 4 * k, out);
#pragma unroll
          for (int j = 0; j < 4; ++j) columns[j][k] = out[j];
        }
        const int valid = p.rows - r < kSeg ? static_cast<int>(p.rows - r) : kSeg;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (c + j < p.cols)
            store16(p.out_t + (c + j) * p.out_t_stride + r,
                    make_uint4(columns[j][0], columns[j][1], columns[j][2], columns[j][3]), valid,
                    p.vec_out_t);
      }
      __syncthreads();  // the next tile overwrites `tile`
    }
  }

  if (p.amax == nullptr) return;
  amax = __reduce_max_sync(0xffffffffu, amax);
  if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) amax = max(amax, warp_amax[w]);
    if (amax != 0) atomicMax(p.amax, amax);
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

bool is_fp8(fastffn_dtype dtype) {
  return dtype == FASTFFN_DTYPE_FP8_E4M3 || dtype == FASTFFN_DTYPE_FP8_E5M2;
}

bool shaped(const fastffn_tensor& t, int64_t rows, int64_t cols) {
  return t.rows == rows && t.cols == cols && t.row_stride >= cols;
}

bool aliased(const float* a, const float* b) { return a != nullptr && a == b; }

bool bytes_aligned16(const void* p, int64_t row_stride) {
  return aligned16(p) && row_stride % 16 == 0;
}

// Blocks of a persistent grid: every SM filled to the kernel's occupancy, never more than tiles.
template <typename Kernel>
int64_t persistent_blocks(Kernel kernel, int64_t tiles, int sm_count) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess ||
      per_sm < 1)
    per_sm = 1;
  const int64_t cap = static_cast<int64_t>(per_sm) * (sm_count > 0 ? sm_count : 1);
  return tiles < 1 ? 1 : (tiles < cap ? tiles : cap);
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;

extern "C" fastffn_status fastffn_fp8_quantize_cuda(fastffn_tensor x, fastffn_tensor out,
                                                    fastffn_tensor out_t, void* stream) {
  const bool empty = x.rows == 0 || x.cols == 0;
  if (x.rows < 0 || x.cols < 0 || x.row_stride < x.cols || (x.data == nullptr && !empty))
    return FASTFFN_STATUS_INVALID_ARGUMENT;
  if (!is_fp8(out.dtype)) return FASTFFN_STATUS_UNSUPPORTED_DTYPE;
  if (out.data != nullptr && !shaped(out, x.rows, x.cols)) return FASTFFN_STATUS_INVALID_ARGUMENT;
  if (out_t.data != nullptr && (out_t.dtype != out.dtype || !shaped(out_t, x.cols, x.rows)))
    return FASTFFN_STATUS_INVALID_ARGUMENT;
  if (aliased(out.scale, out.scale_inv) || aliased(out.scale, out.amax) ||
      aliased(out.scale_inv, out.amax))
    return FASTFFN_STATUS_INVALID_ARGUMENT;  // each is read or written by every block
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
    p.col_tiles = (x.cols + kTile - 1) / kTile;
    p.tiles = empty ? 0 : (x.rows + kTile - 1) / kTile * p.col_tiles;
    p.scale = out.scale;
    p.scale_inv = out.scale_inv;
    p.amax = reinterpret_cast<unsigned int*>(out.amax);
    p.vec_x = aligned16(x.data) && stride_aligned16<T>(x.row_stride);
    p.vec_out = bytes_aligned16(out.data, out.row_stride);
    p.vec_out_t = bytes_aligned16(out_t.data, out_t.row_stride);
    return FASTFFN_BOOL_SWITCH(out.dtype == FASTFFN_DTYPE_FP8_E5M2, kE5M2, [&] {
      constexpr __nv_fp8_interpretation_t F = kE5M2 ? __NV_E5M2 : __NV_E4M3;
      return FASTFFN_BOOL_SWITCH(out_t.data != nullptr, kTranspose, [&] {
        auto kernel = quantize_kernel<T, F, kTranspose>;
        const int64_t blocks = persistent_blocks(kernel, p.tiles, limits.sm_count);
        kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, s>>>(p);
        return launch_status();
      });
    });
  });
}

extern "C" fastffn_status fastffn_fp8_dequantize_cuda(fastffn_tensor q, fastffn_tensor y,
                                                      void* stream) {
  if (!is_fp8(q.dtype)) return FASTFFN_STATUS_UNSUPPORTED_DTYPE;
  if (q.rows < 0 || q.cols < 0 || q.row_stride < q.cols || !shaped(y, q.rows, q.cols))
    return FASTFFN_STATUS_INVALID_ARGUMENT;
  if (q.rows == 0 || q.cols == 0) return FASTFFN_STATUS_OK;
  if (q.data == nullptr || y.data == nullptr) return FASTFFN_STATUS_INVALID_ARGUMENT;
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
