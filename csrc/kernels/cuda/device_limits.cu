// Device limits read from the driver once per device and cached: launch plans use them instead
// of one GPU's numbers (fastffn_device_limits in the C API).
#include <mutex>

#include "cuda_common.cuh"

namespace {

constexpr int kMaxDevices = 64;
std::once_flag g_once[kMaxDevices];
fastffn_device_limits g_limits[kMaxDevices];
fastffn_status g_status[kMaxDevices];

fastffn_status query(int device, fastffn_device_limits* out) {
  int sms = 0, shared = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return FASTFFN_STATUS_CUDA_ERROR;
  out->sm_count = sms;
  out->max_shared_bytes_per_block = shared;
  return FASTFFN_STATUS_OK;
}

}  // namespace

extern "C" fastffn_status fastffn_device_limits_cuda(int device, fastffn_device_limits* limits) {
  if (limits == nullptr || device < 0) return FASTFFN_STATUS_INVALID_ARGUMENT;
  if (device >= kMaxDevices) return query(device, limits);
  std::call_once(g_once[device], [device] { g_status[device] = query(device, &g_limits[device]); });
  if (g_status[device] == FASTFFN_STATUS_OK) *limits = g_limits[device];
  return g_status[device];
}

namespace fastffn {
namespace cuda {

fastffn_status current_device_limits(fastffn_device_limits* limits) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return FASTFFN_STATUS_CUDA_ERROR;
  return fastffn_device_limits_cuda(device, limits);
}

}  // namespace cuda
}  // namespace fastffn
