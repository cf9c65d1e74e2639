// Helpers shared by the FP8 Paddle bindings (fp8_op.cc, swiglu_fp8_op.cc): FP8 format names ->
// dtypes, argument checks that name the argument, tensor -> fastffn_tensor descriptors, the CUDA-only
// refusal, and the zero columns that pad a transposed FP8 copy. Translation only, no math.
#pragma once

#include <string>
#include <vector>

#include "binding_utils.h"
#include "fastffn/scaled_tensor.h"

#if defined(PADDLE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace fastffn {
namespace paddle_binding {

inline paddle::DataType fp8_dtype_of(const std::string& fmt, const char* op, const char* attr = "fmt") {
  if (fmt == "e4m3") return paddle::DataType::FLOAT8_E4M3FN;
  if (fmt == "e5m2") return paddle::DataType::FLOAT8_E5M2;
  PD_THROW(op, ": attribute `", attr, "` must be \"e4m3\" or \"e5m2\", got \"", fmt, "\"");
}

inline fastffn_dtype fp8_kernel_dtype(const std::string& fmt) {
  return fmt == "e4m3" ? FASTFFN_DTYPE_FP8_E4M3 : FASTFFN_DTYPE_FP8_E5M2;
}

inline bool is_fp8(const paddle::Tensor& t) {
  return t.dtype() == paddle::DataType::FLOAT8_E4M3FN || t.dtype() == paddle::DataType::FLOAT8_E5M2;
}

inline void check_matrix(const paddle::Tensor& t, const char* arg, const char* op) {
  PD_CHECK(t.shape().size() == 2, op, ": argument `", arg, "` must be 2-D, got ",
           t.shape().size(), " dimensions");
  check_contiguous(t, arg, op);
}

// A 16-bit or fp32 input of a quantising kernel (the kernels have no float64 variant).
inline fastffn_dtype quantizable_dtype(const paddle::Tensor& t, const char* arg, const char* op) {
  const fastffn_dtype dtype = kernel_dtype(t, op, arg);
  PD_CHECK(t.dtype() != paddle::DataType::FLOAT64, op, ": argument `", arg,
           "` must be bfloat16, float16 or float32, got float64");
  return dtype;
}

// An fp32 device scalar (exactly_one), or a vector whose element 0 is the one the kernel uses.
inline void check_fp32(const paddle::Tensor& t, const char* arg, const char* op, bool exactly_one) {
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, op, ": argument `", arg, "` must be float32, got ",
           phi::DataTypeToString(t.dtype()));
  PD_CHECK(exactly_one ? t.numel() == 1 : t.numel() >= 1, op, ": argument `", arg, "` must hold ",
           exactly_one ? "exactly one element" : "at least one element", ", got ", t.numel());
  check_contiguous(t, arg, op);
}

// The columns of a transposed copy: 0 means the rows of its source; otherwise at least those.
inline void check_transpose_cols(int64_t transpose_cols, int64_t rows, bool transpose,
                                 const char* source_arg, const char* op) {
  PD_CHECK(transpose_cols == 0 || transpose_cols >= rows, op,
           ": attribute `transpose_cols` must be 0 (= the rows of `", source_arg,
           "`) or at least the rows of `", source_arg, "` (", rows, "), got ", transpose_cols);
  PD_CHECK(transpose || transpose_cols == 0, op, ": attribute `transpose_cols` needs `transpose`");
}

inline fastffn_tensor describe(const paddle::Tensor& t, fastffn_dtype dtype) {
  fastffn_tensor d{};
  d.data = const_cast<void*>(t.data());
  d.dtype = dtype;
  d.rows = t.shape()[0];
  d.cols = t.shape()[1];
  d.row_stride = d.cols;
  return d;
}

// A descriptor with no data (an output not asked for): its dtype and shape only.
inline fastffn_tensor absent(fastffn_dtype dtype, int64_t rows, int64_t cols) {
  fastffn_tensor d{};
  d.dtype = dtype;
  d.rows = rows;
  d.cols = cols;
  d.row_stride = cols;
  return d;
}

inline float* fp32_ptr(const paddle::Tensor& t) { return const_cast<float*>(t.data<float>()); }

// The last step before a kernel call: FP8 has CUDA kernels only (cuBLASLt FP8 on Hopper).
inline void require_cuda(const paddle::Tensor& t, const char* op) {
  PD_CHECK(t.is_gpu(), op, ": got a tensor on ", t.place().DebugString(),
           "; FP8 needs a CUDA tensor on an sm_90 (Hopper) GPU and a CUDA build of Paddle (the CPU "
           "path is the emulated one: paddle_fastffn.fp8.fp8_linear / fp8_ffn)");
}

// The shape of a transposed copy of a [rows, cols] tensor: [cols, transpose_cols or rows].
inline std::vector<int64_t> transposed_shape(int64_t rows, int64_t cols, bool transpose,
                                             int64_t transpose_cols) {
  if (!transpose) return {0};
  return {cols, transpose_cols > 0 ? transpose_cols : rows};
}

// A transposed FP8 output `out_t` [R, C] of which the kernel writes the first `written` columns:
// its descriptor (row stride C), after zeroing columns [written, C) on `stream`. The zero columns
// pad the K of a weight-gradient GEMM (the tokens) to a multiple of 16 and change no result.
#if defined(PADDLE_WITH_CUDA)
inline fastffn_status padded_transposed(const paddle::Tensor& out_t, fastffn_dtype dtype,
                                        int64_t written, cudaStream_t stream, fastffn_tensor* desc) {
  const int64_t rows = out_t.shape()[0], cols = out_t.shape()[1];
  *desc = absent(dtype, rows, written);
  desc->data = const_cast<void*>(out_t.data());
  desc->row_stride = cols;
  if (cols > written && rows > 0 &&
      cudaMemset2DAsync(static_cast<char*>(desc->data) + written, cols, 0, cols - written, rows,
                        stream) != cudaSuccess)
    return FASTFFN_STATUS_CUDA_ERROR;
  return FASTFFN_STATUS_OK;
}
#endif

// The FP8 outputs of one quantising pass over a [rows, cols] tensor, allocated on `place`:
// data [rows, cols] (rowwise), data_t [cols, transpose_cols or rows] (transpose), scale_inv [1]
// when either is written ([0] for an amax-only pass), each [0] where not asked for; and their
// descriptors, with `scale` read and `amax` accumulated (each may be NULL). prepare() zeroes
// data_t's padding columns and points desc_t at it, on the stream of the kernel call.
struct Fp8Output {
  paddle::Tensor data, data_t, scale_inv;
  fastffn_tensor desc, desc_t;
  int64_t rows;

#if defined(PADDLE_WITH_CUDA)
  fastffn_status prepare(cudaStream_t stream) {
    if (data_t.numel() == 0) return FASTFFN_STATUS_OK;
    return padded_transposed(data_t, desc_t.dtype, rows, stream, &desc_t);
  }
#endif
};

inline Fp8Output fp8_output(const phi::Place& place, const std::string& fmt, const char* op,
                            int64_t rows, int64_t cols, bool rowwise, bool transpose,
                            int64_t transpose_cols, float* scale, float* amax) {
  const paddle::DataType fp8 = fp8_dtype_of(fmt, op);
  const fastffn_dtype dtype = fp8_kernel_dtype(fmt);
  const bool converts = rowwise || transpose;
  Fp8Output out;
  out.rows = rows;
  out.data = paddle::empty(rowwise ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{0}, fp8,
                           place);
  out.data_t = paddle::empty(transposed_shape(rows, cols, transpose, transpose_cols), fp8, place);
  out.scale_inv = paddle::empty({converts ? 1 : 0}, paddle::DataType::FLOAT32, place);
  out.desc = rowwise ? describe(out.data, dtype) : absent(dtype, rows, cols);
  out.desc.scale = scale;
  out.desc.scale_inv = converts ? out.scale_inv.data<float>() : nullptr;
  out.desc.amax = amax;
  out.desc_t = absent(dtype, cols, rows);
  return out;
}

}  // namespace paddle_binding
}  // namespace fastffn
