// Shared pieces of the FP8 kernels (fp8_cast.cu, swiglu_fp8.cu): the FP8 conversion with the
// formats' saturation and Inf/NaN rules of fastffn/scaled_tensor.h, 16-element loads and stores,
// the 128 x 128 tile transpose through shared memory, the block amax and the persistent grid.
//
// Tiles: 256 threads walk a 128 x 128 tile of the (row-major) output. A thread converts 16
// consecutive elements of a row (a "segment") into 16 FP8 bytes, stores them row-wise with one
// 16-byte store and parks them in shared memory (swizzled: tile_slot); after a barrier
// store_tile_transposed gathers 16 rows x 4 columns of bytes per thread, transposes them with byte
// permutes and writes four 16-byte pieces of transposed rows. The 8 lanes that share 4 columns
// cover all 128 rows of the tile, so each warp store writes 4 whole 128-byte lines of the
// transposed copy (a warp per 16 rows writes 32 half sectors per store: cast+transpose measured
// 53-60% of copy bandwidth, benchmarks/results/run8/ at commit 8c5140e).
//
// amax is a max over the bit patterns of |x| as unsigned integers: for non-negative floats the
// integer order is the float order, every NaN pattern sorts above Inf (so a NaN wins), and neither
// flush-to-zero (--use_fast_math) nor fmaxf's NaN dropping can change it.
#pragma once

#include <cuda_fp8.h>

#include <type_traits>

#include "cuda_common.cuh"
#include "fastffn/scaled_tensor.h"

namespace fastffn {
namespace cuda {

constexpr int kTileThreads = 256;                                   // threads of a tile block
constexpr int kTile = 128;                                          // rows and columns per tile
constexpr int kSeg = 16;                                            // elements per thread access
constexpr int kSegsPerRow = kTile / kSeg;                           // 8
constexpr int kSegsPerThread = kTile * kSegsPerRow / kTileThreads;  // 4
constexpr int kTileWords = kTile / 4;                               // 32-bit words per tile row
constexpr int kTileBytes = kTile * kTile;                           // one FP8 tile in shared memory
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kFp8NaN = 0x7fu;  // S.1111.111 is e4m3's NaN, S.11111.11 one of e5m2's

static_assert(kTile * kSegsPerRow % kTileThreads == 0, "whole segments per thread");
static_assert(kTileThreads / 32 == kSegsPerRow && kTile / kSeg == 8,
              "transpose phase: one warp per segment, 8 lanes per 16-row group");

// Load order of the tile kernels. A store through a uint8_t pointer may alias any input, so the
// compiler cannot move the next segment's loads above this segment's FP8 stores: written as "load,
// convert, store" per segment, a thread has one segment of loads in flight at a time. The kernels
// therefore load one segment ahead, the next tile's first after a tile's last, explicitly (tile_seg
// below). Measured on the H200 against "load, convert, store" (benchmarks/results/run14/ at commit
// 8c5140e: fp8_ffn.json, prefetch_sweep): SwiGLU forward 6-8% faster, 11-14% with gate_up's FP8
// copy; cast + transpose within +-2%. Loading a whole tile ahead instead (four segments; 117-127
// registers, two blocks per SM) made cast + transpose take 17-19% longer
// (fp8_ffn_call1_quantize_whole_tile_rejected.json there).

// sm_80 emulates the FP8 conversion (dozens of instructions per value, and their registers): there
// the next segment is loaded after this one is converted, so one segment is live (with it ahead,
// the fp32-input SwiGLU forward spilled on sm_80). FP8 runs on sm_89+ only; sm_80 code must build.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr bool kLoadAhead = false;
#else
constexpr bool kLoadAhead = true;
#endif

// Where segment i (0 .. kSegsPerThread - 1) of this thread lies in the tile whose first element
// is (r0, c0) of a [rows, cols] matrix: valid = 0 outside the matrix.
struct TileSeg {
  int64_t r, c;  // matrix row and first column
  int row, seg;  // tile row and segment in the row
  int valid;     // elements inside the matrix (0 .. kSeg)
};

__device__ __forceinline__ TileSeg tile_seg(int64_t r0, int64_t c0, int i, int64_t rows, int64_t cols) {
  TileSeg s;
  const int linear = i * kTileThreads + static_cast<int>(threadIdx.x);
  s.row = linear / kSegsPerRow;
  s.seg = linear % kSegsPerRow;
  s.r = r0 + s.row;
  s.c = c0 + s.seg * kSeg;
  s.valid = s.r >= rows || s.c >= cols ? 0 : (cols - s.c < kSeg ? static_cast<int>(cols - s.c) : kSeg);
  return s;
}

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

// 4 values -> 4 FP8 bytes, little-endian in a uint32_t. `special`: some x or x * scale is not
// finite, so bytes are patched where the format's Inf/NaN rules differ from the saturating
// conversion (rare; the common path is two paired conversions).
template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ uint32_t quantize4(const float* x, float scale, bool special) {
  uint32_t w = fp8x2<F>(x[0] * scale, x[1] * scale) | (fp8x2<F>(x[2] * scale, x[3] * scale) << 16);
  if (special) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t byte = special_byte<F>(x[j], x[j] * scale);
      if (byte != kKeep) w = (w & ~(0xffu << (8 * j))) | (byte << (8 * j));
    }
  }
  return w;
}

// 16 values -> 16 FP8 bytes in a uint4 (four quantize4; `special` as there, for any of the 16).
template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ uint4 quantize16(const float (&x)[kSeg], float scale, bool special) {
  return make_uint4(quantize4<F>(x, scale, special), quantize4<F>(x + 4, scale, special),
                    quantize4<F>(x + 8, scale, special), quantize4<F>(x + 12, scale, special));
}

// max |x| of 4 values as bits.
__device__ __forceinline__ uint32_t amax_bits4(const float (&x)[4]) {
  return max(max(abs_bits(x[0]), abs_bits(x[1])), max(abs_bits(x[2]), abs_bits(x[3])));
}

// max |x| of 16 values as bits (see the top of the file).
__device__ __forceinline__ uint32_t amax_bits16(const float (&x)[kSeg]) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kSeg; ++j) m = max(m, abs_bits(x[j]));
  return m;
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

// A segment's 16 elements of T kept as packed 32-bit words (8 registers for 16-bit T), for
// kernels that must hold several segments' inputs at once: a Vec<T, 16> of 16-bit values would
// take a register per element. Elements are converted to fp32 where they are used.
template <typename T>
struct PackedSeg {
  static constexpr int kWords = kSeg * static_cast<int>(sizeof(T)) / 4;
  uint32_t w[kWords];

  __device__ __forceinline__ float get(int j) const {  // j: a compile-time index after unrolling
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[j]);
    } else {
      const unsigned short bits = static_cast<unsigned short>(w[j / 2] >> (16 * (j % 2)));
      if constexpr (std::is_same_v<T, __nv_bfloat16>) return to_float(__ushort_as_bfloat16(bits));
      else return to_float(__ushort_as_half(bits));
    }
  }

  __device__ __forceinline__ void set(int j, float v) {  // rounds v to T
    const T t = from_float<T>(v);
    if constexpr (sizeof(T) == 4) {
      w[j] = __float_as_uint(t);
    } else {
      unsigned short bits;
      memcpy(&bits, &t, sizeof(bits));
      const int shift = 16 * (j % 2);
      w[j / 2] = (w[j / 2] & ~(0xffffu << shift)) | (static_cast<uint32_t>(bits) << shift);
    }
  }

  // `valid` (1..16) elements at p (zeros after them); 16-byte loads when `vec` and full.
  __device__ __forceinline__ void load(const T* p, int valid, bool vec) {
    if (vec && valid == kSeg) {
#pragma unroll
      for (int k = 0; k < kWords / 4; ++k) {
        const uint4 q = reinterpret_cast<const uint4*>(p)[k];
        w[4 * k] = q.x; w[4 * k + 1] = q.y; w[4 * k + 2] = q.z; w[4 * k + 3] = q.w;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kWords; ++k) w[k] = 0;  // +0 in every format
#pragma unroll
      for (int j = 0; j < kSeg; ++j)
        if (j < valid) set(j, to_float(p[j]));  // exact: T -> fp32 -> T
    }
  }

  // The first `valid` elements to p: 16-byte stores when `vec` and full.
  __device__ __forceinline__ void store(T* p, int valid, bool vec) const {
    if (vec && valid == kSeg) {
#pragma unroll
      for (int k = 0; k < kWords / 4; ++k)
        reinterpret_cast<uint4*>(p)[k] =
            make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
    } else {
#pragma unroll
      for (int j = 0; j < kSeg; ++j)
        if (j < valid) p[j] = from_float<T>(get(j));
    }
  }
};

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

// The first `valid` of 16 values to p, rounded to T: 16-byte stores when `vec` and full.
template <typename T>
__device__ __forceinline__ void store16_values(T* p, const float (&x)[kSeg], int valid, bool vec) {
  if (vec && valid == kSeg) {
    constexpr int V = kVecWidth<T>;
#pragma unroll
    for (int i = 0; i < kSeg; i += V) {
      Vec<T, V> v;
#pragma unroll
      for (int j = 0; j < V; ++j) v.v[j] = from_float<T>(x[i + j]);
      store_vec<V>(p + i, v);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kSeg; ++j)
      if (j < valid) p[j] = from_float<T>(x[j]);
  }
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

// Where (tile row, segment) lives in a tile's shared memory: the segment index XOR-swizzled by
// the row's 16-row group. store_tile_transposed's warp reads one 32-bit word from each of 8 row
// groups x 4 words of one segment: with the swizzle those are 32 distinct banks (without it, 8 rows
// 16 apart share a bank). The fills stay conflict-free: a quarter warp stores one row's 8 segments,
// a permutation of the row's 8 slots.
__device__ __forceinline__ int tile_slot(int row, int seg) {
  return row * kSegsPerRow + (seg ^ ((row / kSeg) & (kSegsPerRow - 1)));
}

// The transposed copy of one tile: `tile` holds the FP8 bytes of rows r0 .. r0 + 127, columns
// c0 .. c0 + 127 of a [rows, cols] matrix (tile[tile_slot(row, seg)] = bytes of columns
// seg * 16 .. + 15 of tile row `row`); writes out_t[c, r] ([cols, rows], row stride
// out_t_stride) for the elements inside the matrix. Called by all kTileThreads threads between
// the barriers that fill and reuse `tile`.
__device__ __forceinline__ void store_tile_transposed(const uint4* tile, int64_t r0, int64_t c0,
                                                      int64_t rows, int64_t cols, uint8_t* out_t,
                                                      int64_t out_t_stride, bool vec) {
  const int seg = threadIdx.x >> 5;        // warp: tile segment (input columns 16 seg .. + 15)
  const int group = threadIdx.x & 7;       // input rows r0 + 16 group .. + 15
  const int word = (threadIdx.x >> 3) & 3; // input columns 16 seg + 4 word .. + 3 of the segment
  const int64_t r = r0 + group * kSeg;
  const int64_t c = c0 + seg * kSeg + 4 * word;
  if (r >= rows || c >= cols) return;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(tile);
  uint32_t w[kSeg];
#pragma unroll
  for (int i = 0; i < kSeg; ++i) w[i] = words[tile_slot(group * kSeg + i, seg) * 4 + word];
  uint32_t columns[4][4];  // [input column j][word k: input rows 4k .. 4k + 3]
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t out[4];
    transpose4x4(w + 4 * k, out);
#pragma unroll
    for (int j = 0; j < 4; ++j) columns[j][k] = out[j];
  }
  const int valid = rows - r < kSeg ? static_cast<int>(rows - r) : kSeg;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (c + j < cols)
      store16(out_t + (c + j) * out_t_stride + r,
              make_uint4(columns[j][0], columns[j][1], columns[j][2], columns[j][3]), valid, vec);
}

// The block's max of `bits` (one per thread) into *amax with one atomicMax (skipped for 0).
// Called by all threads of a kTileThreads block; `scratch` is kTileThreads / 32 shared words
// that no other call of this function uses at the same time.
__device__ __forceinline__ void block_amax_to(unsigned int* amax, uint32_t bits,
                                              uint32_t* scratch) {
  bits = __reduce_max_sync(0xffffffffu, bits);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < kTileThreads / 32; ++w) bits = max(bits, scratch[w]);
    if (bits != 0) atomicMax(amax, bits);
  }
}

// --- host-side argument helpers -------------------------------------------------------------

inline bool is_fp8(fastffn_dtype dtype) {
  return dtype == FASTFFN_DTYPE_FP8_E4M3 || dtype == FASTFFN_DTYPE_FP8_E5M2;
}

inline bool shaped(const fastffn_tensor& t, int64_t rows, int64_t cols) {
  return t.rows == rows && t.cols == cols && t.row_stride >= cols;
}

// fastffn_last_error names the tensor and both shapes when `t` is not [rows, cols].
inline fastffn_status check_shaped(const char* entry, const char* arg, const fastffn_tensor& t,
                                   int64_t rows, int64_t cols) {
  FASTFFN_CHECK_ARG(shaped(t, rows, cols), entry,
                    "%s must be [%lld, %lld] with a row stride >= %lld, got [%lld, %lld] with row "
                    "stride %lld", arg, (long long)rows, (long long)cols, (long long)cols,
                    (long long)t.rows, (long long)t.cols, (long long)t.row_stride);
  return FASTFFN_STATUS_OK;
}

inline fastffn_status check_fp8(const char* entry, const char* arg, fastffn_dtype dtype) {
  FASTFFN_CHECK(is_fp8(dtype), FASTFFN_STATUS_UNSUPPORTED_DTYPE, entry,
                "%s must be FP8_E4M3 or FP8_E5M2, got %s", arg, ::fastffn::dtype_name(dtype));
  return FASTFFN_STATUS_OK;
}

inline bool aliased(const float* a, const float* b) { return a != nullptr && a == b; }

// scale, scale_inv and amax of one FP8 output are each read or written by every block.
inline bool scaling_aliased(const fastffn_tensor& t) {
  return aliased(t.scale, t.scale_inv) || aliased(t.scale, t.amax) ||
         aliased(t.scale_inv, t.amax);
}

inline bool bytes_aligned16(const void* p, int64_t row_stride) {
  return aligned16(p) && row_stride % 16 == 0;
}

// Blocks of a persistent FP8 grid (kTileThreads per block): cuda_common.cuh's persistent_blocks.
template <typename Kernel>
int64_t persistent_tile_blocks(Kernel kernel, int64_t tiles, int sm_count, size_t dynamic_shared = 0) {
  return persistent_blocks(kernel, tiles, kTileThreads, sm_count, dynamic_shared);
}

}  // namespace cuda
}  // namespace fastffn
