// SwiGLU fused with per-tensor FP8 quantisation, and the scale updates of per-tensor FP8 scaling
// (contracts in fastffn/scaled_tensor.h).
//
// Both SwiGLU kernels walk the [T, I] output in 128 x 128 tiles over a persistent grid, like
// fp8_cast.cu: a thread loads 16 consecutive gate and up values of a row (and, backward, 16 of
// d_h) with 16-byte loads, computes in fp32 with swiglu.cu's expressions (so the fused kernels and
// the unfused ones then fastffn_fp8_quantize_cuda agree bit for bit), converts to FP8 with
// fp8_common.cuh's rules, stores row-wise with 16-byte stores and parks the bytes in shared
// memory for the transposed copies (one 16 KiB tile per transposed output). The backward can
// write three transposed outputs (d_gate^T, d_up^T, h^T), 48 KiB of tiles: dynamic shared memory
// with the opt-in, sized to the outputs asked for.
//
// The forward can also write the FP8 copy of gate_up (row-wise, the bytes fastffn_fp8_quantize_cuda
// would write) and the backward read it in place of the 16-bit gate_up: the FFN then keeps
// [T, 2I] bytes for its backward instead of [T, 2I] 16-bit values, and the backward reads half the
// bytes of its largest input.
#include <cfloat>
#include <cmath>

#include "fp8_common.cuh"

namespace fastffn {
namespace cuda {
namespace {

constexpr int kTileSegs = kTile * kSegsPerRow;  // uint4 entries of one shared FP8 tile
constexpr size_t kTileSharedBytes = kTileSegs * sizeof(uint4);
constexpr size_t kDefaultSharedBytes = 48 * 1024;  // per block without the opt-in
constexpr size_t kBwdStaticShared = 2 * kTileThreads / 32 * sizeof(uint32_t);  // warp_amax

// swiglu.cu's sigmoid, the same expression (see there for why __fdividef).
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

// --- forward -----------------------------------------------------------------------------------

template <typename T>
struct FwdParams {
  const T* gate;  // row r at gate + r * in_stride; up = gate + cols
  const T* up;
  uint8_t* out;    // [rows, cols] or NULL
  uint8_t* out_t;  // [cols, rows] or NULL
  int64_t rows, cols, in_stride, out_stride, out_t_stride;
  int64_t col_tiles, tiles;
  const float* scale;
  float* scale_inv;
  unsigned int* amax;
  // The FP8 copy of gate_up [rows, 2 cols] (or NULL) and its scaling; gu_amax may be NULL.
  uint8_t* gu;
  int64_t gu_stride;
  const float* gu_scale;
  float* gu_scale_inv;
  unsigned int* gu_amax;
  bool vec_gate, vec_up, vec_out, vec_out_t, vec_gu_gate, vec_gu_up;
};

// One segment of the plain forward: h = swiglu(gate, up), its amax and FP8 bytes (row-wise store,
// and the transposed copy's tile).
template <typename T, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void fwd_segment(const FwdParams<T>& p, const float (&g)[kSeg], float (&h)[kSeg],
                                            const TileSeg& s, bool convert, bool transpose, float scale,
                                            bool scale_finite, uint32_t& amax, uint4* tile) {
#pragma unroll
  for (int j = 0; j < kSeg; ++j) h[j] = g[j] * sigmoid(g[j]) * h[j];  // swiglu_fwd_kernel's
  const uint32_t seg_amax = amax_bits16(h);
  amax = max(amax, seg_amax);
  if (!convert) return;
  const uint4 q = quantize16<F>(h, scale, seg_amax >= kInfBits || !scale_finite);
  if (p.out != nullptr) store16(p.out + s.r * p.out_stride + s.c, q, s.valid, p.vec_out);
  if (transpose) tile[tile_slot(s.row, s.seg)] = q;
}

// One segment of the kGateUp forward: h = swiglu(gate, up) and its FP8 bytes (row-wise store,
// and the transposed copy's tile), gate_up's FP8 copy, both amaxes. The inputs stay packed in their
// storage type and are converted four values at a time (swiglu_bwd_fp8_kernel's layout): with both
// 16-value fp32 arrays live beside two quantisations, the kernel took 128 registers (ptxas, sm_90a)
// and half the occupancy.
template <typename T, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void fwd_gate_up_segment(
    const FwdParams<T>& p, const PackedSeg<T>& gate, const PackedSeg<T>& up, const TileSeg& s,
    bool convert, bool transpose, float scale, bool scale_finite, bool gu_convert, float gu_scale,
    bool gu_scale_finite, uint32_t& amax, uint32_t& gu_amax, uint4* tile) {
  uint32_t qg[4], qu[4], qh[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float g4[4], u4[4], h4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      g4[e] = gate.get(4 * k + e);
      u4[e] = up.get(4 * k + e);
      h4[e] = g4[e] * sigmoid(g4[e]) * u4[e];  // swiglu_fwd_kernel's, as in the plain pass
    }
    const uint32_t g_bits = amax_bits4(g4), u_bits = amax_bits4(u4), h_bits = amax_bits4(h4);
    gu_amax = max(gu_amax, max(g_bits, u_bits));
    amax = max(amax, h_bits);
    if (gu_convert) {
      qg[k] = quantize4<F>(g4, gu_scale, g_bits >= kInfBits || !gu_scale_finite);
      qu[k] = quantize4<F>(u4, gu_scale, u_bits >= kInfBits || !gu_scale_finite);
    }
    if (convert) qh[k] = quantize4<F>(h4, scale, h_bits >= kInfBits || !scale_finite);
  }
  if (gu_convert) {
    uint8_t* dst = p.gu + s.r * p.gu_stride + s.c;
    store16(dst, make_uint4(qg[0], qg[1], qg[2], qg[3]), s.valid, p.vec_gu_gate);
    store16(dst + p.cols, make_uint4(qu[0], qu[1], qu[2], qu[3]), s.valid, p.vec_gu_up);
  }
  if (!convert) return;
  const uint4 q = make_uint4(qh[0], qh[1], qh[2], qh[3]);
  if (p.out != nullptr) store16(p.out + s.r * p.out_stride + s.c, q, s.valid, p.vec_out);
  if (transpose) tile[tile_slot(s.row, s.seg)] = q;
}

// kGateUp: gate_up's own amax and/or FP8 copy too. A kernel of its own: written as one kernel
// with a runtime test, the plain pass went from 59 to 91 registers per thread (sm_90a, ptxas -v)
// and lost occupancy it does not need to lose. The kGateUp body keeps its inputs packed. Loading
// one segment ahead (fp8_common.cuh: load order) took it from 75-79 to 110-114 registers for 16-bit
// inputs (two blocks per SM instead of three) and made it 11-14% faster on the H200;
// a minimum of three or four blocks per SM made it spill.
template <typename T, __nv_fp8_interpretation_t F, bool kGateUp>
__global__ void __launch_bounds__(kTileThreads)
swiglu_fwd_fp8_kernel(const FwdParams<T> p) {
  __shared__ uint4 tile[kTileSegs];
  __shared__ uint32_t warp_amax[kGateUp ? 2 : 1][kTileThreads / 32];
  const bool transpose = p.out_t != nullptr;
  const bool convert = p.out != nullptr || transpose;
  const float scale = convert && p.scale != nullptr ? *p.scale : 1.f;
  const bool scale_finite = abs_bits(scale) < kInfBits;
  if (convert && p.scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
    *p.scale_inv = __frcp_rn(scale);
  bool gu_convert = false, gu_scale_finite = true;
  float gu_scale = 1.f;
  uint32_t amax = 0, gu_amax = 0;
  if constexpr (kGateUp) {
    gu_convert = p.gu != nullptr;
    gu_scale = gu_convert && p.gu_scale != nullptr ? *p.gu_scale : 1.f;
    gu_scale_finite = abs_bits(gu_scale) < kInfBits;
    if (gu_convert && p.gu_scale_inv != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
      *p.gu_scale_inv = __frcp_rn(gu_scale);
  }

  // One segment ahead, across tiles (fp8_common.cuh: load order): the next segment's gate and up
  // (the next tile's first one after a tile's last) are loaded, packed, before this segment's
  // stores (sm_80: after, kLoadAhead).
  PackedSeg<T> gate, up, next_gate, next_up;
  auto load = [&](int64_t r0, int64_t c0, int i, PackedSeg<T>& g, PackedSeg<T>& u) {
    const TileSeg s = tile_seg(r0, c0, i, p.rows, p.cols);
    if (s.valid == 0) return false;
    g.load(p.gate + s.r * p.in_stride + s.c, s.valid, p.vec_gate);
    u.load(p.up + s.r * p.in_stride + s.c, s.valid, p.vec_up);
    return true;
  };
  int64_t r0 = blockIdx.x / p.col_tiles * kTile, c0 = blockIdx.x % p.col_tiles * kTile;
  bool in = blockIdx.x < p.tiles && load(r0, c0, 0, gate, up);
  for (int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const int64_t next_t = t + gridDim.x;
    const int64_t next_r0 = next_t / p.col_tiles * kTile, next_c0 = next_t % p.col_tiles * kTile;
#pragma unroll 1
    for (int i = 0; i < kSegsPerThread; ++i) {
      const bool last = i + 1 == kSegsPerThread;
      auto load_next = [&] {
        return last ? next_t < p.tiles && load(next_r0, next_c0, 0, next_gate, next_up)
                    : load(r0, c0, i + 1, next_gate, next_up);
      };
      bool next_in = false;
      if constexpr (kLoadAhead) next_in = load_next();
      if (in) {
        const TileSeg s = tile_seg(r0, c0, i, p.rows, p.cols);
        if constexpr (kGateUp) {
          fwd_gate_up_segment<T, F>(p, gate, up, s, convert, transpose, scale, scale_finite,
                                    gu_convert, gu_scale, gu_scale_finite, amax, gu_amax, tile);
        } else {
          float g[kSeg], h[kSeg];
#pragma unroll
          for (int j = 0; j < kSeg; ++j) {
            g[j] = gate.get(j);
            h[j] = up.get(j);
          }
          fwd_segment<T, F>(p, g, h, s, convert, transpose, scale, scale_finite, amax, tile);
        }
      }
      if constexpr (!kLoadAhead) next_in = load_next();
      gate = next_gate;
      up = next_up;
      in = next_in;
    }
    if (transpose) {
      __syncthreads();
      store_tile_transposed(tile, r0, c0, p.rows, p.cols, p.out_t, p.out_t_stride, p.vec_out_t);
      __syncthreads();  // the next tile overwrites `tile`
    }
    r0 = next_r0;
    c0 = next_c0;
  }

  if (p.amax != nullptr) block_amax_to(p.amax, amax, warp_amax[0]);
  if constexpr (kGateUp)
    if (p.gu_amax != nullptr) block_amax_to(p.gu_amax, gu_amax, warp_amax[1]);
}

// --- backward ----------------------------------------------------------------------------------

template <typename T>
struct BwdParams {
  // row r at gate + r * in_stride; up = gate + cols. In T, or FP8 bytes (the forward's copy of
  // gate_up) to be multiplied by *gate_up_scale_inv (NULL = 1).
  const void* gate;
  const void* up;
  const float* gate_up_scale_inv;
  const T* d_h;
  int64_t rows, cols, in_stride, d_h_stride;
  // d_gate_up [rows, 2 cols] (d_gate then d_up in each row) and its transpose [2 cols, rows]
  uint8_t* dgu;
  uint8_t* dgu_t;
  int64_t dgu_stride, dgu_t_stride;
  const float* dgu_scale;
  float* dgu_scale_inv;
  unsigned int* dgu_amax;
  // recomputed h [rows, cols]: FP8 (h_fp8) or T; its FP8 transpose [cols, rows]
  void* h;
  uint8_t* h_t;
  int64_t h_stride, h_t_stride;
  const float* h_scale;
  float* h_scale_inv;
  unsigned int* h_amax;
  bool h_fp8;
  int64_t col_tiles, tiles;
  bool vec_gate, vec_up, vec_d_h, vec_dg, vec_du, vec_dgu_t, vec_h, vec_h_t;
};

// 16 FP8 bytes of format F kept packed (4 registers), the FP8 gate_up's segment: get4 (below)
// converts four of them to fp32, unscaled (the caller applies scale_inv).
template <__nv_fp8_interpretation_t F>
struct Fp8Seg {
  uint32_t w[4];

  // `valid` (1..16) bytes at p (+0 after them); one 16-byte load when `vec` and full.
  __device__ __forceinline__ void load(const uint8_t* p, int valid, bool vec) {
    if (vec && valid == kSeg) {
      const uint4 q = *reinterpret_cast<const uint4*>(p);
      w[0] = q.x; w[1] = q.y; w[2] = q.z; w[3] = q.w;
      return;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = 0;
#pragma unroll
    for (int j = 0; j < kSeg; ++j)
      if (j < valid) w[j / 4] |= static_cast<uint32_t>(p[j]) << (8 * (j % 4));
  }
};

// Values 4k .. 4k + 3 of a segment in fp32; an FP8 segment converts them two at a time.
template <typename Seg>
__device__ __forceinline__ void get4(const Seg& seg, int k, float (&out)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) out[e] = seg.get(4 * k + e);
}

template <__nv_fp8_interpretation_t F>  // exact: every FP8 value is an fp16 value
__device__ __forceinline__ void get4(const Fp8Seg<F>& seg, int k, float (&out)[4]) {
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const auto bytes = static_cast<__nv_fp8x2_storage_t>(seg.w[k] >> (16 * pair));
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(bytes, F)));
    out[2 * pair] = f.x;
    out[2 * pair + 1] = f.y;
  }
}

// The gate, up and d_h values of one segment in their storage type (zeros past the matrix).
// kFp8GateUp: gate and up are FP8 of format FG (the forward's copy), else T.
template <typename T, bool kFp8GateUp, __nv_fp8_interpretation_t FG>
struct SwigluBwdInputs {
  using GateUpSeg = std::conditional_t<kFp8GateUp, Fp8Seg<FG>, PackedSeg<T>>;
  using GateUpElem = std::conditional_t<kFp8GateUp, uint8_t, T>;
  GateUpSeg gate, up;
  PackedSeg<T> d_h;

  // Segment i of the tile at (r0, c0); false (nothing loaded) when it lies outside the matrix.
  __device__ __forceinline__ bool load(const BwdParams<T>& p, int64_t r0, int64_t c0, int i) {
    const int s = i * kTileThreads + threadIdx.x;
    const int64_t r = r0 + s / kSegsPerRow, c = c0 + s % kSegsPerRow * kSeg;
    if (r >= p.rows || c >= p.cols) return false;
    const int valid = p.cols - c < kSeg ? static_cast<int>(p.cols - c) : kSeg;
    gate.load(static_cast<const GateUpElem*>(p.gate) + r * p.in_stride + c, valid, p.vec_gate);
    up.load(static_cast<const GateUpElem*>(p.up) + r * p.in_stride + c, valid, p.vec_up);
    d_h.load(p.d_h + r * p.d_h_stride + c, valid, p.vec_d_h);
    return true;
  }
};

// FH: the format of an FP8 h, and of gate_up when kFp8GateUp.
template <typename T, __nv_fp8_interpretation_t FD, __nv_fp8_interpretation_t FH, bool kFp8GateUp>
__global__ void __launch_bounds__(kTileThreads) swiglu_bwd_fp8_kernel(const BwdParams<T> p) {
  // Transposed outputs' tiles, in this order: d_gate^T, d_up^T (when dgu_t), h^T (when h_t).
  extern __shared__ uint4 tiles[];
  __shared__ uint32_t warp_amax[2][kTileThreads / 32];  // kBwdStaticShared bytes
  const bool dgu_transpose = p.dgu_t != nullptr;
  const bool h_transpose = p.h_t != nullptr;
  const bool dgu_convert = p.dgu != nullptr || dgu_transpose;
  const bool h_convert = p.h_fp8 && (p.h != nullptr || h_transpose);
  const bool h_needed = p.h != nullptr || h_transpose || p.h_amax != nullptr;
  const bool h_values_out = !p.h_fp8 && p.h != nullptr;  // h written in T, not FP8
  const float dgu_scale = dgu_convert && p.dgu_scale != nullptr ? *p.dgu_scale : 1.f;
  const float h_scale = h_convert && p.h_scale != nullptr ? *p.h_scale : 1.f;
  const bool dgu_scale_finite = abs_bits(dgu_scale) < kInfBits;
  const bool h_scale_finite = abs_bits(h_scale) < kInfBits;
  // 1 for a 16-bit gate_up, where the compiler drops the multiplies (kFp8GateUp is constexpr).
  const float gu_scale_inv =
      kFp8GateUp && p.gate_up_scale_inv != nullptr ? *p.gate_up_scale_inv : 1.f;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (dgu_convert && p.dgu_scale_inv != nullptr) *p.dgu_scale_inv = __frcp_rn(dgu_scale);
    if (h_convert && p.h_scale_inv != nullptr) *p.h_scale_inv = __frcp_rn(h_scale);
  }
  uint4* tile_dg = tiles;
  uint4* tile_du = tiles + kTileSegs;
  uint4* tile_h = tiles + (dgu_transpose ? 2 * kTileSegs : 0);
  uint32_t dgu_amax = 0, h_amax = 0;

  for (int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const int64_t r0 = t / p.col_tiles * kTile;
    const int64_t c0 = t % p.col_tiles * kTile;
    // Segment i of this tile: tile row s / kSegsPerRow, columns 16 (s % kSegsPerRow) .., with
    // s = i * kTileThreads + threadIdx.x. Its inputs stay in their 16-bit storage (24 registers)
    // and are converted four values at a time, so few fp32 values are live: the next segment's
    // loads are issued before the current one is computed (two segments, 192 bytes, in flight
    // per thread). A loop holding four 16-value fp32 arrays per segment (about 128 registers) and
    // one segment of loads in flight reached 65% of copy bandwidth, even with no stores; this loop
    // 85-91%. Staging the inputs through shared memory with cp.async was slower (48%). H200;
    // benchmarks/results/run9/ at commit 8c5140e (fp8_quant_and_ffn*.json).
    SwigluBwdInputs<T, kFp8GateUp, FH> cur, next;
    bool cur_in = cur.load(p, r0, c0, 0);
#pragma unroll 1
    for (int i = 0; i < kSegsPerThread; ++i) {
      const bool next_in = i + 1 < kSegsPerThread && next.load(p, r0, c0, i + 1);
      if (cur_in) {
        const int s = i * kTileThreads + threadIdx.x;
        const int row = s / kSegsPerRow, seg = s % kSegsPerRow;
        const int64_t r = r0 + row, c = c0 + seg * kSeg;
        const int valid = p.cols - c < kSeg ? static_cast<int>(p.cols - c) : kSeg;
        uint32_t qg[4], qu[4], qh[4];
        PackedSeg<T> h_values;  // h in T, when that is the output asked for (h_values_out)
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // swiglu_bwd_kernel's expressions, four values at a time
          float dg[4], du[4], h[4], gate4[4], up4[4];
          get4(cur.gate, k, gate4);
          get4(cur.up, k, up4);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = gate4[e], up = up4[e];
            if constexpr (kFp8GateUp) {
              x *= gu_scale_inv;
              up *= gu_scale_inv;
            }
            const float dy = cur.d_h.get(4 * k + e);
            const float sig = sigmoid(x);
            const float silu = x * sig;
            dg[e] = dy * up * sig * (1.f + x * (1.f - sig));
            du[e] = dy * silu;
            h[e] = silu * up;
          }
          const uint32_t dg_bits = amax_bits4(dg), du_bits = amax_bits4(du);
          dgu_amax = max(dgu_amax, max(dg_bits, du_bits));
          if (dgu_convert) {
            qg[k] = quantize4<FD>(dg, dgu_scale, !dgu_scale_finite || dg_bits >= kInfBits);
            qu[k] = quantize4<FD>(du, dgu_scale, !dgu_scale_finite || du_bits >= kInfBits);
          }
          if (h_needed) {
            const uint32_t h_bits = amax_bits4(h);
            h_amax = max(h_amax, h_bits);
            if (h_convert) qh[k] = quantize4<FH>(h, h_scale, !h_scale_finite || h_bits >= kInfBits);
#pragma unroll
            for (int e = 0; e < 4; ++e)
            if (h_values_out) h_values.set(4 * k + e, h[e]);
          }
        }
        if (dgu_convert) {
          const uint4 g4 = make_uint4(qg[0], qg[1], qg[2], qg[3]);
          const uint4 u4 = make_uint4(qu[0], qu[1], qu[2], qu[3]);
          if (p.dgu != nullptr) {
            uint8_t* dst = p.dgu + r * p.dgu_stride + c;
            store16(dst, g4, valid, p.vec_dg);
            store16(dst + p.cols, u4, valid, p.vec_du);
          }
          if (dgu_transpose) {
            tile_dg[tile_slot(row, seg)] = g4;
            tile_du[tile_slot(row, seg)] = u4;
          }
        }
        if (h_convert) {
          const uint4 h4 = make_uint4(qh[0], qh[1], qh[2], qh[3]);
          if (p.h != nullptr)
            store16(static_cast<uint8_t*>(p.h) + r * p.h_stride + c, h4, valid, p.vec_h);
          if (h_transpose) tile_h[tile_slot(row, seg)] = h4;
        } else if (h_values_out) {
          h_values.store(static_cast<T*>(p.h) + r * p.h_stride + c, valid, p.vec_h);
        }
      }
      cur = next;
      cur_in = next_in;
    }
    if (dgu_transpose || h_transpose) {
      __syncthreads();
      if (dgu_transpose) {
        store_tile_transposed(tile_dg, r0, c0, p.rows, p.cols, p.dgu_t, p.dgu_t_stride,
                              p.vec_dgu_t);
        store_tile_transposed(tile_du, r0, c0, p.rows, p.cols, p.dgu_t + p.cols * p.dgu_t_stride,
                              p.dgu_t_stride, p.vec_dgu_t);
      }
      if (h_transpose)
        store_tile_transposed(tile_h, r0, c0, p.rows, p.cols, p.h_t, p.h_t_stride, p.vec_h_t);
      __syncthreads();  // the next tile overwrites the tiles
    }
  }
  if (p.dgu_amax != nullptr) block_amax_to(p.dgu_amax, dgu_amax, warp_amax[0]);
  if (p.h_amax != nullptr) block_amax_to(p.h_amax, h_amax, warp_amax[1]);
}

// --- scales ------------------------------------------------------------------------------------

// Transformer Engine's delayed-scaling update: scaled_max / amax for a finite amax > 0 (IEEE
// division: --use_fast_math would otherwise make it approximate), the previous scale for an amax
// that is 0, negative, Inf or NaN, and FLT_MAX where the quotient overflows (amax tiny).
__device__ __forceinline__ float scale_from_amax(float amax, float previous, float scaled_max) {
  const uint32_t bits = __float_as_uint(amax);
  if (bits == 0 || bits >= kInfBits) return previous;  // +0; sign bit set, Inf and NaN sort above
  const float scale = __fdiv_rn(scaled_max, amax);
  return abs_bits(scale) >= kInfBits ? FLT_MAX : scale;
}

__device__ __forceinline__ void write_scale(float scale, float* out, float* out_inv) {
  *out = scale;
  if (out_inv != nullptr) *out_inv = __frcp_rn(scale);
}

__global__ void compute_scale_kernel(const float* amax, float* scale, float* scale_inv,
                                     float scaled_max) {
  write_scale(scale_from_amax(*amax, *scale, scaled_max), scale, scale_inv);
}

constexpr int kHistoryThreads = 256;

// One block. history[0] holds the amax of the step that ends (the kernels accumulate into it);
// as TE's amax_and_scale_update: amax = max over the whole history (fmaxf: a NaN entry is
// skipped) or history[0] (most_recent), then the history rolls by one: history[len - 1] =
// the old history[0], history[i] = the old history[i + 1] for 0 < i < len - 1, history[0] = 0.
__global__ void __launch_bounds__(kHistoryThreads)
update_history_kernel(float* history, int64_t len, bool most_recent, float* scale,
                      float* scale_inv, float scaled_max) {
  __shared__ float warp_max[kHistoryThreads / 32];
  const float last = history[0];
  float amax = 0.f;
  for (int64_t off = 0; off < len; off += kHistoryThreads) {
    const int64_t i = off + threadIdx.x;
    float a = 0.f;
    if (i < len) {
      a = i < len - 1 ? history[i + 1] : last;
      amax = fmaxf(amax, a);
    }
    __syncthreads();  // every read of this chunk before its in-place writes
    if (i < len) history[i] = i > 0 ? a : 0.f;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x != 0) return;
#pragma unroll
  for (int w = 1; w < kHistoryThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  write_scale(scale_from_amax(most_recent ? last : amax, *scale, scaled_max), scale, scale_inv);
}

// --- host helpers ------------------------------------------------------------------------------

// fmt_max * 2^-margin in fp32 (TE computes it on the host the same way), or 0 when the result
// is not a positive normal float (then the entry point returns INVALID_ARGUMENT).
float scaled_max_of(float fmt_max, float margin) {
  const double value = static_cast<double>(fmt_max) * std::exp2(-static_cast<double>(margin));
  const float scaled = static_cast<float>(value);
  return scaled >= FLT_MIN && scaled <= FLT_MAX ? scaled : 0.f;
}

fastffn_status check_2d(const char* entry, const char* arg, const fastffn_tensor& t) {
  const bool empty = t.rows == 0 || t.cols == 0;
  FASTFFN_CHECK_ARG(t.rows >= 0 && t.cols >= 0 && t.row_stride >= t.cols, entry,
                    "%s must have rows, cols >= 0 and row_stride >= cols, got [%lld, %lld] stride "
                    "%lld", arg, (long long)t.rows, (long long)t.cols, (long long)t.row_stride);
  FASTFFN_CHECK_ARG(t.data != nullptr || empty, entry, "%s.data must not be NULL", arg);
  return FASTFFN_STATUS_OK;
}

// The gate | up input of both kernels: [T, 2I], 2I even.
fastffn_status check_gate_up(const char* entry, const fastffn_tensor& t) {
  FASTFFN_TRY_STATUS(check_2d(entry, "gate_up", t));
  FASTFFN_CHECK_ARG(t.cols % 2 == 0, entry,
                    "gate_up packs [gate | up] in each row, so its cols must be even, got %lld",
                    (long long)t.cols);
  return ::fastffn::ok();
}

// No two of the scaling scalars alias where one is written (both scales may be one tensor).
bool scalars_distinct(const fastffn_tensor& a, const fastffn_tensor& b) {
  const float* written[] = {a.scale_inv, a.amax, b.scale_inv, b.amax};
  const float* all[] = {a.scale, b.scale, a.scale_inv, a.amax, b.scale_inv, b.amax};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j)
      if (j != i + 2 && aliased(written[i], all[j])) return false;
  return true;
}

template <typename T>
bool rows_aligned16(const void* p, int64_t stride_elems) {
  return aligned16(p) && stride_aligned16<T>(stride_elems);
}

}  // namespace
}  // namespace cuda
}  // namespace fastffn

using namespace fastffn::cuda;

extern "C" fastffn_status fastffn_swiglu_fwd_fp8_cuda(fastffn_tensor gate_up, fastffn_tensor out_h,
                                                      fastffn_tensor out_h_t,
                                                      fastffn_tensor out_gate_up, void* stream) {
  const char* entry = __func__;
  FASTFFN_TRY_STATUS(check_gate_up(entry, gate_up));
  FASTFFN_TRY_STATUS(::fastffn::check_storage_dtype(entry, "gate_up.dtype", gate_up.dtype, false));
  FASTFFN_TRY_STATUS(check_fp8(entry, "out_h.dtype", out_h.dtype));
  const int64_t rows = gate_up.rows, cols = gate_up.cols / 2;
  if (out_h.data != nullptr) FASTFFN_TRY_STATUS(check_shaped(entry, "out_h", out_h, rows, cols));
  if (out_h_t.data != nullptr) {
    FASTFFN_CHECK_ARG(out_h_t.dtype == out_h.dtype, entry, "out_h_t.dtype must be out_h.dtype (%s)",
                      ::fastffn::dtype_name(out_h.dtype));
    FASTFFN_TRY_STATUS(check_shaped(entry, "out_h_t", out_h_t, cols, rows));
  }
  const bool gu_wanted = out_gate_up.data != nullptr || out_gate_up.amax != nullptr;
  FASTFFN_CHECK(!gu_wanted || out_gate_up.dtype == out_h.dtype, FASTFFN_STATUS_UNSUPPORTED_DTYPE,
                entry, "out_gate_up.dtype (%s) must be out_h.dtype (%s), the forward format",
                ::fastffn::dtype_name(out_gate_up.dtype), ::fastffn::dtype_name(out_h.dtype));
  if (out_gate_up.data != nullptr)
    FASTFFN_TRY_STATUS(check_shaped(entry, "out_gate_up", out_gate_up, rows, 2 * cols));
  const fastffn_tensor gu_scaling = gu_wanted ? out_gate_up : fastffn_tensor{};
  FASTFFN_CHECK_ARG(!scaling_aliased(out_h) && scalars_distinct(out_h, gu_scaling), entry,
                    "the scale, scale_inv and amax of out_h and out_gate_up must not alias where "
                    "one is written (the two scales may be one)");
  fastffn_device_limits limits;
  const fastffn_status queried = current_device_limits(&limits);
  if (queried != FASTFFN_STATUS_OK) return queried;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(gate_up.dtype, [&](auto tag) {
    using T = decltype(tag);
    FwdParams<T> p;
    p.gate = static_cast<const T*>(gate_up.data);
    p.up = p.gate + cols;
    p.out = static_cast<uint8_t*>(out_h.data);
    p.out_t = static_cast<uint8_t*>(out_h_t.data);
    p.rows = rows;
    p.cols = cols;
    p.in_stride = gate_up.row_stride;
    p.out_stride = out_h.row_stride;
    p.out_t_stride = out_h_t.row_stride;
    // At least 1: every block divides by it for its first tile, even when there is none.
    p.col_tiles = cols == 0 ? 1 : (cols + kTile - 1) / kTile;
    p.tiles = rows == 0 || cols == 0 ? 0 : (rows + kTile - 1) / kTile * p.col_tiles;
    p.scale = out_h.scale;
    p.scale_inv = out_h.scale_inv;
    p.amax = reinterpret_cast<unsigned int*>(out_h.amax);
    p.gu = static_cast<uint8_t*>(out_gate_up.data);
    p.gu_stride = out_gate_up.row_stride;
    p.gu_scale = gu_scaling.scale;
    p.gu_scale_inv = gu_scaling.scale_inv;
    p.gu_amax = reinterpret_cast<unsigned int*>(gu_scaling.amax);
    p.vec_gate = rows_aligned16<T>(p.gate, gate_up.row_stride);
    p.vec_up = rows_aligned16<T>(p.up, gate_up.row_stride);
    p.vec_out = bytes_aligned16(out_h.data, out_h.row_stride);
    p.vec_out_t = bytes_aligned16(out_h_t.data, out_h_t.row_stride);
    p.vec_gu_gate = bytes_aligned16(p.gu, p.gu_stride);
    p.vec_gu_up = p.gu != nullptr && bytes_aligned16(p.gu + cols, p.gu_stride);
    return FASTFFN_BOOL_SWITCH(out_h.dtype == FASTFFN_DTYPE_FP8_E5M2, kE5M2, [&] {
      return FASTFFN_BOOL_SWITCH(gu_wanted, kGateUp, [&] {
        auto kernel = swiglu_fwd_fp8_kernel<T, kE5M2 ? __NV_E5M2 : __NV_E4M3, kGateUp>;
        const int64_t blocks = persistent_tile_blocks(kernel, p.tiles, limits.sm_count);
        kernel<<<static_cast<unsigned int>(blocks), kTileThreads, 0, s>>>(p);
        return launch_status();
      });
    });
  });
}

extern "C" fastffn_status fastffn_swiglu_bwd_fp8_cuda(fastffn_tensor gate_up, fastffn_tensor d_h,
                                                      fastffn_tensor d_gate_up,
                                                      fastffn_tensor d_gate_up_t, fastffn_tensor h,
                                                      fastffn_tensor h_t, void* stream) {
  const char* entry = __func__;
  const auto unsupported = FASTFFN_STATUS_UNSUPPORTED_DTYPE;
  FASTFFN_TRY_STATUS(check_gate_up(entry, gate_up));
  const int64_t rows = gate_up.rows, cols = gate_up.cols / 2;
  // gate_up in d_h's dtype, or the forward's FP8 copy (then d_h's dtype is the 16/32-bit one).
  const bool gate_up_fp8 = is_fp8(gate_up.dtype);
  FASTFFN_TRY_STATUS(::fastffn::check_storage_dtype(entry, "d_h.dtype", d_h.dtype, false));
  FASTFFN_CHECK(gate_up_fp8 || d_h.dtype == gate_up.dtype, unsupported, entry,
                "gate_up.dtype (%s) must be d_h's (%s) or FP8", ::fastffn::dtype_name(gate_up.dtype),
                ::fastffn::dtype_name(d_h.dtype));
  FASTFFN_CHECK_ARG(gate_up_fp8 || gate_up.scale_inv == nullptr, entry,
                    "gate_up.scale_inv is only for an FP8 gate_up");
  FASTFFN_TRY_STATUS(check_2d(entry, "d_h", d_h));
  FASTFFN_TRY_STATUS(check_shaped(entry, "d_h", d_h, rows, cols));
  FASTFFN_TRY_STATUS(check_fp8(entry, "d_gate_up.dtype", d_gate_up.dtype));
  if (d_gate_up.data != nullptr)
    FASTFFN_TRY_STATUS(check_shaped(entry, "d_gate_up", d_gate_up, rows, 2 * cols));
  if (d_gate_up_t.data != nullptr) {
    FASTFFN_CHECK_ARG(d_gate_up_t.dtype == d_gate_up.dtype, entry,
                      "d_gate_up_t.dtype must be d_gate_up.dtype (%s)",
                      ::fastffn::dtype_name(d_gate_up.dtype));
    FASTFFN_TRY_STATUS(check_shaped(entry, "d_gate_up_t", d_gate_up_t, 2 * cols, rows));
  }
  const bool h_wanted = h.data != nullptr || h_t.data != nullptr || h.amax != nullptr;
  const bool h_fp8 = h_wanted && is_fp8(h.dtype);
  FASTFFN_CHECK(!(h_fp8 && gate_up_fp8) || h.dtype == gate_up.dtype, unsupported, entry,
                "an FP8 h (%s) must be in the FP8 gate_up's format (%s)",
                ::fastffn::dtype_name(h.dtype), ::fastffn::dtype_name(gate_up.dtype));
  if (h_wanted && !h_fp8) {  // the recomputed h in d_h's dtype, as fastffn_swiglu_bwd_cuda's
    FASTFFN_CHECK(h.dtype == d_h.dtype, unsupported, entry,
                  "h.dtype (%s) must be FP8 or d_h's dtype (%s)", ::fastffn::dtype_name(h.dtype),
                  ::fastffn::dtype_name(d_h.dtype));
    FASTFFN_CHECK_ARG(h_t.data == nullptr && h.scale == nullptr && h.scale_inv == nullptr &&
                          h.amax == nullptr,
                      entry, "h_t and h's scale, scale_inv and amax are for an FP8 h only");
  }
  if (h.data != nullptr) FASTFFN_TRY_STATUS(check_shaped(entry, "h", h, rows, cols));
  if (h_t.data != nullptr) {
    FASTFFN_CHECK_ARG(h_t.dtype == h.dtype, entry, "h_t.dtype must be h.dtype (%s)",
                      ::fastffn::dtype_name(h.dtype));
    FASTFFN_TRY_STATUS(check_shaped(entry, "h_t", h_t, cols, rows));
  }
  const fastffn_tensor h_scaling = h_fp8 ? h : fastffn_tensor{};
  FASTFFN_CHECK_ARG(scalars_distinct(d_gate_up, h_scaling), entry,
                    "the scale_inv and amax of d_gate_up and h must be distinct from every other "
                    "of their scalars (the two scales may be one)");
  // gate_up's scale_inv is read by every block while block 0 writes the outputs' scale_inv.
  for (const float* written : {d_gate_up.scale_inv, d_gate_up.amax, h_scaling.scale_inv, h_scaling.amax})
    FASTFFN_CHECK_ARG(!aliased(gate_up.scale_inv, written), entry,
                      "gate_up.scale_inv must not be a scalar this call writes");

  fastffn_device_limits limits;
  const fastffn_status queried = current_device_limits(&limits);
  if (queried != FASTFFN_STATUS_OK) return queried;
  const int tiles_needed = (d_gate_up_t.data != nullptr ? 2 : 0) + (h_t.data != nullptr ? 1 : 0);
  const size_t shared = tiles_needed * kTileSharedBytes;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return dispatch_dtype(d_h.dtype, [&](auto tag) {
    using T = decltype(tag);
    BwdParams<T> p;
    const size_t gate_up_elem = gate_up_fp8 ? 1 : sizeof(T);
    p.gate = gate_up.data;
    p.up = static_cast<const char*>(gate_up.data) + cols * gate_up_elem;
    p.gate_up_scale_inv = gate_up.scale_inv;
    p.d_h = static_cast<const T*>(d_h.data);
    p.rows = rows;
    p.cols = cols;
    p.in_stride = gate_up.row_stride;
    p.d_h_stride = d_h.row_stride;
    p.dgu = static_cast<uint8_t*>(d_gate_up.data);
    p.dgu_t = static_cast<uint8_t*>(d_gate_up_t.data);
    p.dgu_stride = d_gate_up.row_stride;
    p.dgu_t_stride = d_gate_up_t.row_stride;
    p.dgu_scale = d_gate_up.scale;
    p.dgu_scale_inv = d_gate_up.scale_inv;
    p.dgu_amax = reinterpret_cast<unsigned int*>(d_gate_up.amax);
    p.h = h.data;
    p.h_t = static_cast<uint8_t*>(h_t.data);
    p.h_stride = h.row_stride;
    p.h_t_stride = h_t.row_stride;
    p.h_scale = h_scaling.scale;
    p.h_scale_inv = h_scaling.scale_inv;
    p.h_amax = reinterpret_cast<unsigned int*>(h_scaling.amax);
    p.h_fp8 = h_fp8;
    p.col_tiles = (cols + kTile - 1) / kTile;
    p.tiles = rows == 0 || cols == 0 ? 0 : (rows + kTile - 1) / kTile * p.col_tiles;
    p.vec_gate = gate_up_fp8 ? bytes_aligned16(p.gate, gate_up.row_stride)
                             : rows_aligned16<T>(p.gate, gate_up.row_stride);
    p.vec_up = gate_up_fp8 ? bytes_aligned16(p.up, gate_up.row_stride)
                           : rows_aligned16<T>(p.up, gate_up.row_stride);
    p.vec_d_h = rows_aligned16<T>(d_h.data, d_h.row_stride);
    p.vec_dg = bytes_aligned16(p.dgu, p.dgu_stride);
    p.vec_du = p.dgu != nullptr && bytes_aligned16(p.dgu + cols, p.dgu_stride);
    p.vec_dgu_t = bytes_aligned16(p.dgu_t, p.dgu_t_stride);
    p.vec_h = h_fp8 ? bytes_aligned16(h.data, h.row_stride)
                    : rows_aligned16<T>(h.data, h.row_stride);
    p.vec_h_t = bytes_aligned16(p.h_t, p.h_t_stride);
    const bool d_e5m2 = d_gate_up.dtype == FASTFFN_DTYPE_FP8_E5M2;
    // The forward format: an FP8 h's, and an FP8 gate_up's (checked to be the same above).
    const fastffn_dtype forward_fp8 = h_fp8 ? h.dtype : gate_up.dtype;
    const bool h_e5m2 = (h_fp8 || gate_up_fp8) && forward_fp8 == FASTFFN_DTYPE_FP8_E5M2;
    return FASTFFN_BOOL_SWITCH(d_e5m2, kDE5M2, [&] {
      return FASTFFN_BOOL_SWITCH(h_e5m2, kHE5M2, [&] {
       return FASTFFN_BOOL_SWITCH(gate_up_fp8, kFp8GateUp, [&] {
        auto kernel = swiglu_bwd_fp8_kernel<T, kDE5M2 ? __NV_E5M2 : __NV_E4M3,
                                            kHE5M2 ? __NV_E5M2 : __NV_E4M3, kFp8GateUp>;
        if (shared + kBwdStaticShared > kDefaultSharedBytes) {  // 3 tiles: needs the opt-in
          // Not on any device of sm_80 or newer.
          FASTFFN_CHECK_ARG(shared + kBwdStaticShared <=
                                static_cast<size_t>(limits.max_shared_bytes_per_block),
                            entry, "d_gate_up_t and h_t together need %zu bytes of shared memory "
                            "per block; this device has %d", shared + kBwdStaticShared,
                            limits.max_shared_bytes_per_block);
          FASTFFN_TRY_STATUS(cuda_status(
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(shared)),
              entry, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)"));
        }
        const int64_t blocks = persistent_tile_blocks(kernel, p.tiles, limits.sm_count, shared);
        kernel<<<static_cast<unsigned int>(blocks), kTileThreads, shared, s>>>(p);
        return launch_status();
       });
      });
    });
  });
}

extern "C" fastffn_status fastffn_fp8_compute_scale_cuda(const float* amax, float* scale,
                                                         float* scale_inv, float fmt_max,
                                                         float margin, void* stream) {
  const float scaled_max = scaled_max_of(fmt_max, margin);
  FASTFFN_CHECK_ARG(amax != nullptr && scale != nullptr, __func__, "amax and scale must not be NULL");
  FASTFFN_CHECK_ARG(scaled_max != 0.f, __func__,
                    "fmt_max * 2^-margin (%g * 2^-%g) must be a positive normal float",
                    static_cast<double>(fmt_max), static_cast<double>(margin));
  FASTFFN_CHECK_ARG(!aliased(amax, scale) && !aliased(scale_inv, scale) && !aliased(scale_inv, amax),
                    __func__, "amax, scale and scale_inv must be distinct pointers");
  ::fastffn::ok();
  compute_scale_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(amax, scale, scale_inv,
                                                                       scaled_max);
  return launch_status();
}

extern "C" fastffn_status fastffn_fp8_update_amax_history_cuda(float* amax_history,
                                                               int64_t history_len,
                                                               int most_recent, float* scale,
                                                               float* scale_inv, float fmt_max,
                                                               float margin, void* stream) {
  const float scaled_max = scaled_max_of(fmt_max, margin);
  FASTFFN_CHECK_ARG(amax_history != nullptr && scale != nullptr, __func__,
                    "amax_history and scale must not be NULL");
  FASTFFN_CHECK_ARG(history_len >= 1, __func__, "history_len must be >= 1, got %lld",
                    (long long)history_len);
  FASTFFN_CHECK_ARG(scaled_max != 0.f, __func__,
                    "fmt_max * 2^-margin (%g * 2^-%g) must be a positive normal float",
                    static_cast<double>(fmt_max), static_cast<double>(margin));
  FASTFFN_CHECK_ARG(!aliased(scale_inv, scale), __func__, "scale and scale_inv must be distinct");
  const auto inside = [&](const float* p) {
    return p != nullptr && p >= amax_history && p < amax_history + history_len;
  };
  FASTFFN_CHECK_ARG(!inside(scale) && !inside(scale_inv), __func__,
                    "scale and scale_inv must not point into amax_history");
  ::fastffn::ok();
  update_history_kernel<<<1, kHistoryThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      amax_history, history_len, most_recent != 0, scale, scale_inv, scaled_max);
  return launch_status();
}
