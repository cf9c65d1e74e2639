// Launch plans: pure host functions of the problem size and the device's limits, so that the
// choice of a kernel variant can be tested on a machine without a GPU (tests/ops/test_launch_plan.py)
// for any device's numbers, and the CUDA entry points never assume one GPU's limits.
#include "fastffn/c_api.h"

namespace {

// Persistent backward blocks per SM: each block keeps one [cols] fp32 partial of the weight
// gradient; 4 per SM keeps every SM busy while the partials stay few (the final reduction reads
// blocks x cols floats). Measured on the H200 with 132 SMs (528 blocks):
// benchmarks/results/gpu_h200.json at commit 8c5140e.
constexpr int64_t kRmsNormBwdBlocksPerSm = 4;
// The block's static shared memory beside the dynamic partials (block_sum's 32-float scratch).
constexpr int64_t kRmsNormBwdStaticShared = 32 * sizeof(float);
// Without the opt-in, a launch may use 48 KiB of dynamic shared memory on every architecture.
constexpr int64_t kDefaultSharedBytes = 48 * 1024;

}  // namespace

extern "C" fastffn_rms_norm_bwd_plan fastffn_plan_rms_norm_bwd(int64_t rows, int64_t cols,
                                                               fastffn_device_limits limits) {
  fastffn_rms_norm_bwd_plan plan{};
  const int64_t sms = limits.sm_count > 0 ? limits.sm_count : 1;
  const int64_t max_blocks = kRmsNormBwdBlocksPerSm * sms;
  plan.blocks = rows < max_blocks ? (rows > 0 ? rows : 1) : max_blocks;
  const int64_t partial_bytes = (cols > 0 ? cols : 0) * static_cast<int64_t>(sizeof(float));
  int64_t shared_limit = limits.max_shared_bytes_per_block - kRmsNormBwdStaticShared;
  if (shared_limit < kDefaultSharedBytes - kRmsNormBwdStaticShared)
    shared_limit = kDefaultSharedBytes - kRmsNormBwdStaticShared;
  plan.shared_partials = partial_bytes <= shared_limit ? 1 : 0;
  plan.shared_bytes = plan.shared_partials ? partial_bytes : 0;
  plan.workspace_bytes = plan.blocks * partial_bytes;
  return plan;
}
