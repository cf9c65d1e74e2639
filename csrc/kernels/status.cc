// Status strings and the per-thread last-error message of the C API (fastffn_last_error): every
// entry point that fails records why, through fastffn::fail (validate.h), so the callers (the Paddle
// bindings, the GPU harness) only translate status + message into their framework's error.
#include <cstdarg>
#include <cstdio>
#include <string>

#include "validate.h"

namespace {

thread_local std::string g_last_error;

}  // namespace

namespace fastffn {

fastffn_status fail(fastffn_status status, const char* entry, const char* format, ...) {
  char message[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof(message), format, args);
  va_end(args);
  g_last_error = std::string(entry) + ": " + message;
  return status;
}

fastffn_status ok() {
  g_last_error.clear();
  return FASTFFN_STATUS_OK;
}

const char* dtype_name(fastffn_dtype dtype) {
  switch (dtype) {
    case FASTFFN_DTYPE_FLOAT32: return "FLOAT32";
    case FASTFFN_DTYPE_FLOAT16: return "FLOAT16";
    case FASTFFN_DTYPE_BFLOAT16: return "BFLOAT16";
    case FASTFFN_DTYPE_FLOAT64: return "FLOAT64";
    case FASTFFN_DTYPE_FP8_E4M3: return "FP8_E4M3";
    case FASTFFN_DTYPE_FP8_E5M2: return "FP8_E5M2";
  }
  return "an unknown dtype";
}

}  // namespace fastffn

extern "C" const char* fastffn_last_error(void) { return g_last_error.c_str(); }

extern "C" const char* fastffn_status_string(fastffn_status status) {
  switch (status) {
    case FASTFFN_STATUS_OK: return "ok";
    case FASTFFN_STATUS_INVALID_ARGUMENT: return "invalid argument";
    case FASTFFN_STATUS_UNSUPPORTED_DTYPE: return "unsupported dtype";
    case FASTFFN_STATUS_CUDA_ERROR: return "CUDA error";
    case FASTFFN_STATUS_LIBRARY_MISSING: return "cuBLASLt could not be loaded";
    case FASTFFN_STATUS_LIBRARY_ERROR: return "cuBLASLt failed";
  }
  return "unknown status";
}
