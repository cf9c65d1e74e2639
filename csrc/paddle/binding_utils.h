// Helpers shared by the Paddle bindings: Paddle dtype -> kernel dtype, checks of what only the
// binding sees (contiguity, places, tensor shapes), status + fastffn_last_error -> exception, and the device switch (CPU kernels always; CUDA kernels only when
// Paddle itself was built with CUDA). Bindings translate and check; they hold no math.
#pragma once

#include <string>
#include <vector>

#include "fastffn/c_api.h"
#include "paddle/extension.h"

namespace fastffn {
namespace paddle_binding {

inline fastffn_dtype kernel_dtype(const paddle::Tensor& t, const char* op, const char* arg) {
  switch (t.dtype()) {
    case paddle::DataType::FLOAT32: return FASTFFN_DTYPE_FLOAT32;
    case paddle::DataType::FLOAT64: return FASTFFN_DTYPE_FLOAT64;
    case paddle::DataType::FLOAT16: return FASTFFN_DTYPE_FLOAT16;
    case paddle::DataType::BFLOAT16: return FASTFFN_DTYPE_BFLOAT16;
    default:
      PD_THROW(op, ": argument `", arg, "` must be float32, float16, bfloat16 or float64, got ",
               phi::DataTypeToString(t.dtype()));
  }
}

inline void check_same_dtype(const paddle::Tensor& ref, const char* ref_arg,
                             const paddle::Tensor& t, const char* arg, const char* op) {
  PD_CHECK(t.dtype() == ref.dtype(), op, ": argument `", arg, "` must have the dtype of `", ref_arg,
           "` (", phi::DataTypeToString(ref.dtype()), "), got ", phi::DataTypeToString(t.dtype()));
}

inline void check_same_place(const paddle::Tensor& ref, const paddle::Tensor& t, const char* arg,
                             const char* op) {
  PD_CHECK(t.place() == ref.place(), op, ": argument `", arg,
           "` must be on the same device as the first input");
}

inline void check_contiguous(const paddle::Tensor& t, const char* arg, const char* op) {
  PD_CHECK(t.is_contiguous(), op, ": argument `", arg,
           "` must be contiguous (the Python wrapper makes it so)");
}

// A failed kernel call as Paddle's error, with the C layer's own message (fastffn_last_error):
// the shape and dtype rules of the kernels are checked there, once, not again here.
inline void check_status(fastffn_status status, const char* op) {
  PD_CHECK(status == FASTFFN_STATUS_OK, op, ": ", fastffn_status_string(status), ": ",
           fastffn_last_error());
}

inline int64_t rows_of(const paddle::Tensor& t) {
  const auto shape = t.shape();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return rows;
}

// Runs the CPU or the CUDA variant of a kernel call. `cuda_call` receives the tensor's stream as
// void*; it is only compiled where Paddle has CUDA, so a CPU build never references GPU symbols.
template <typename CpuCall, typename CudaCall>
fastffn_status run_on_device(const paddle::Tensor& t, const char* op, CpuCall&& cpu_call,
                             CudaCall&& cuda_call) {
  if (t.is_cpu()) return cpu_call();
#if defined(PADDLE_WITH_CUDA)
  if (t.is_gpu()) return cuda_call(static_cast<void*>(t.stream()));
#else
  (void)cuda_call;
#endif
  PD_THROW(op, ": unsupported device ", t.place().DebugString(),
           "; paddle_fastffn runs on CPU and on CUDA GPUs");
}

}  // namespace paddle_binding
}  // namespace fastffn
