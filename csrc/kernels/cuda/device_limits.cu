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
  FASTFFN_TRY_STATUS(fastffn::cuda::cuda_status(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
      "fastffn_device_limits_cuda", "cudaDeviceGetAttribute(MultiProcessorCount)"));
  FASTFFN_TRY_STATUS(fastffn::cuda::cuda_status(
      cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
      "fastffn_device_limits_cuda", "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)"));
  out->sm_count = sms;
  out->max_shared_bytes_per_block = shared;
  return FASTFFN_STATUS_OK;
}

}  // namespace

extern "C" fastffn_status fastffn_device_limits_cuda(int device, fastffn_device_limits* limits) {
  FASTFFN_CHECK_ARG(limits != nullptr && device >= 0, __func__,
                    "limits must not be NULL and device (%d) must be >= 0", device);
  if (device >= kMaxDevices) return query(device, limits);
  std::call_once(g_once[device], [device] { g_status[device] = query(device, &g_limits[device]); });
  if (g_status[device] != FASTFFN_STATUS_OK)  // the cached failure, named again in this thread
    return fastffn::fail(g_status[device], __func__, "reading device %d's limits failed earlier",
                         device);
  *limits = g_limits[device];
  return fastffn::ok();
}

namespace fastffn {
namespace cuda {

fastffn_status current_device_limits(fastffn_device_limits* limits) {
  int device = 0;
  FASTFFN_TRY_STATUS(cuda_status(cudaGetDevice(&device), "fastffn current device", "cudaGetDevice"));
  return fastffn_device_limits_cuda(device, limits);
}

}  // namespace cuda
}  // namespace fastffn
