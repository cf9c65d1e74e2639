#include "fastffn/c_api.h"

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
