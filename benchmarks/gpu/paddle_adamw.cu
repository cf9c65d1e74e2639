// Stock Paddle's AdamW update and the squared-L2-norm reduction of its ClipGradByGlobalNorm, ported
// into the GPU harness as the optimizer baseline Paddle users run (the H200 has no Paddle; see
// benchmarks/gpu/paddle_adamw.py for how the pieces are called). Not product code: nothing in
// paddle_fastffn calls this file.
//
// paddle_adamw_cuda: the update of AdamWKernelREG in paddle/phi/kernels/gpu/adamw_kernel.cu
// (PaddlePaddle 3.x, the version with the amsgrad flag that Paddle 3.3.1's _C_ops.adamw_ takes),
// the kernel paddle.optimizer.AdamW launches in dygraph (its beta1^t / beta2^t accumulators live on
// the host, so they come by value), with its launch configuration: 512 threads, one thread per
// element (ceil(n / 512) blocks, grid-stride loop), scalar loads and stores, in place (adamw_'s
// outputs alias its inputs). Its fp32 operations in its order. Per element with an fp32 master:
// reads master, grad, m, v; writes m, v, master and the 16-bit param: 28 bytes for bf16 param and
// grad.
//
// paddle_squared_l2_norm_cuda: what _C_ops.squared_l2_norm does for one gradient (phi's
// ReduceKernel with a square functor: fp32 accumulation, the result in the input's dtype): a
// grid-stride pass writing per-block fp32 partial sums, then one block summing them. Reads the
// gradient once.
//
// Built with the build definition's architectures and -O3, without --use_fast_math: Paddle's
// cmake/cuda.cmake adds none (read in its repository; its kernels keep IEEE division and sqrt).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kAdamwThreads = 512;  // Paddle's block size for this kernel
constexpr int kNormThreads = 256;
constexpr int kNormMaxBlocks = 1024;  // partial sums: at most this many, summed by one block

enum Dtype { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };  // the harness's dtype codes

// Paddle's per-element AdamW (AdamWKernelREG), same operations in the same order, so that its fp32
// roundings are Paddle's: decay the weight first, then the moments, then the bias-corrected step.
// W: the 16-bit parameter type, G: the gradient type; the math is fp32. `amsgrad` is the kernel's
// runtime flag (paddle.optimizer.AdamW(amsgrad=False) by default: v_max neither read nor written).
template <typename W, typename G>
__global__ void paddle_adamw_reg_kernel(float beta1, float beta2, float epsilon, float coeff, float lr_ratio,
                                        float beta1_pow, float beta2_pow, float* moment1, float* moment2,
                                        float* moment2_max, const float* lr_ptr, const G* grad, W* param,
                                        float* master, int64_t n, bool amsgrad) {
  const float lr = *lr_ptr * lr_ratio;
  // 32-bit index arithmetic widened after the product, as Paddle's kernel computes it
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    float weight = master ? master[i] : static_cast<float>(param[i]);
    const float g = static_cast<float>(grad[i]);
    float m = moment1[i];
    float v = moment2[i];

    weight *= (1.0f - lr * coeff);
    m = beta1 * m + (1.0f - beta1) * g;
    v = beta2 * v + (1.0f - beta2) * g * g;

    float v_used = v;
    if (amsgrad) {
      v_used = fmaxf(v, moment2_max[i]);
      moment2_max[i] = v_used;
    }
    const float denominator = (sqrtf(v_used) / sqrtf(1.0f - beta2_pow)) + epsilon;
    weight += (m / denominator) * (-(lr / (1.0f - beta1_pow)));

    moment1[i] = m;
    moment2[i] = v;
    param[i] = static_cast<W>(weight);
    if (master) master[i] = weight;
  }
}

template <typename W, typename G>
void launch_adamw(int64_t n, float beta1, float beta2, float epsilon, float coeff, float lr_ratio,
                  float beta1_pow, float beta2_pow, const float* lr, const void* grad, void* param,
                  float* master, float* moment1, float* moment2, cudaStream_t stream) {
  const int blocks = static_cast<int>((n + kAdamwThreads - 1) / kAdamwThreads);  // one thread per element
  paddle_adamw_reg_kernel<W, G><<<blocks, kAdamwThreads, 0, stream>>>(
      beta1, beta2, epsilon, coeff, lr_ratio, beta1_pow, beta2_pow, moment1, moment2, nullptr, lr,
      static_cast<const G*>(grad), static_cast<W*>(param), master, n, /*amsgrad=*/false);
}

template <typename T>
__device__ float to_float(T x) {
  return static_cast<float>(x);
}

// Sum of one block's `value`s, valid in thread 0.
__device__ float block_sum(float value) {
  __shared__ float warp_sums[kNormThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = value;
  __syncthreads();
  value = threadIdx.x < kNormThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
  if (threadIdx.x < 32) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  return value;
}

template <typename T>
__global__ void squared_partials_kernel(const T* x, int64_t n, float* partials) {
  float sum = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = to_float(x[i]);
    sum += v * v;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

template <typename T>
__global__ void sum_partials_kernel(const float* partials, int count, T* out) {
  float sum = 0.0f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *out = static_cast<T>(sum);
}

template <typename T>
void launch_squared_l2_norm(int64_t n, const void* x, void* out, float* partials, cudaStream_t stream) {
  int64_t wanted = (n + kNormThreads - 1) / kNormThreads;
  int blocks = static_cast<int>(wanted < 1 ? 1 : (wanted > kNormMaxBlocks ? kNormMaxBlocks : wanted));
  squared_partials_kernel<T><<<blocks, kNormThreads, 0, stream>>>(static_cast<const T*>(x), n, partials);
  sum_partials_kernel<T><<<1, kNormThreads, 0, stream>>>(partials, blocks, static_cast<T*>(out));
}

}  // namespace

extern "C" {

// In place, as paddle's adamw_ (outputs alias inputs). param_dtype: 0 fp32, 1 fp16, 2 bf16; master:
// the fp32 copy of a 16-bit param (Paddle's multi_precision) or NULL; grad_dtype: param's, or fp32.
// lr: device fp32 scalar (Paddle's learning-rate tensor). Returns a cudaError_t (0: launched), or
// cudaErrorInvalidValue for a dtype combination Paddle does not register.
int paddle_adamw_cuda(int64_t n, int param_dtype, int grad_dtype, float beta1, float beta2,
                      float epsilon, float coeff, float lr_ratio, int with_decay, float beta1_pow,
                      float beta2_pow, const float* lr, const void* grad, void* param, float* master,
                      float* moment1, float* moment2, cudaStream_t stream) {
  if (n <= 0) return 0;
  if (!with_decay) coeff = 0.0f;  // Paddle: "if with_decay = false, coeff = 0"
  bool fp32_grad = grad_dtype == kFloat32;
  if (grad_dtype != param_dtype && !fp32_grad) return cudaErrorInvalidValue;
  switch (param_dtype) {
    case kFloat32:
      launch_adamw<float, float>(n, beta1, beta2, epsilon, coeff, lr_ratio, beta1_pow, beta2_pow, lr,
                                 grad, param, master, moment1, moment2, stream);
      break;
    case kFloat16:
      (fp32_grad ? launch_adamw<__half, float> : launch_adamw<__half, __half>)(
          n, beta1, beta2, epsilon, coeff, lr_ratio, beta1_pow, beta2_pow, lr, grad, param, master,
          moment1, moment2, stream);
      break;
    case kBFloat16:
      (fp32_grad ? launch_adamw<__nv_bfloat16, float> : launch_adamw<__nv_bfloat16, __nv_bfloat16>)(
          n, beta1, beta2, epsilon, coeff, lr_ratio, beta1_pow, beta2_pow, lr, grad, param, master,
          moment1, moment2, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return static_cast<int>(cudaGetLastError());
}

// Bytes of fp32 partial sums paddle_squared_l2_norm_cuda needs as workspace (any n).
int64_t paddle_squared_l2_norm_workspace_bytes(void) { return kNormMaxBlocks * sizeof(float); }

// out (one element of x's dtype) = sum(x^2), fp32 accumulation. Returns a cudaError_t.
int paddle_squared_l2_norm_cuda(int64_t n, int dtype, const void* x, void* out, float* workspace,
                                cudaStream_t stream) {
  switch (dtype) {
    case kFloat32: launch_squared_l2_norm<float>(n, x, out, workspace, stream); break;
    case kFloat16: launch_squared_l2_norm<__half>(n, x, out, workspace, stream); break;
    case kBFloat16: launch_squared_l2_norm<__nv_bfloat16>(n, x, out, workspace, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
