// Stock Paddle's AdamW update and the squared-L2-norm reduction of its ClipGradByGlobalNorm, ported
// into the GPU harness as the optimizer baseline Paddle users run (the H200 has no Paddle; see
// benchmarks/gpu/paddle_adamw.py for how the pieces are called). Not product code: nothing in
// paddle_fastffn calls this file.
//
// paddle_adamw_cuda: AdamWKernelREG of paddle/phi/kernels/gpu/adamw_kernel.cu (PaddlePaddle 3.x),
// the kernel paddle.optimizer.AdamW launches in dygraph (its beta1^t / beta2^t accumulators live on
// the host, so they come by value), with its launch configuration: 512 threads, one thread per
// element (ceil(n / 512) blocks, grid-stride loop), scalar loads and stores. The arithmetic is
// Paddle's, line for line, in MT = fp32. Per element with an fp32 master: reads master, grad, m, v;
// writes m, v, master and the 16-bit param: 28 bytes for a bf16 param and grad.
//
// paddle_squared_l2_norm_cuda: what _C_ops.squared_l2_norm does for one gradient (phi's
// ReduceKernel with a square functor: fp32 accumulation, the result in the input's dtype): a
// grid-stride pass writing per-block fp32 partial sums, then one block summing them. Reads the
// gradient once.
//
// Built with the build definition's architectures and -O3, without --use_fast_math (Paddle's own
// CUDA flags leave division and sqrt IEEE-rounded).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kAdamwThreads = 512;  // Paddle's `int threads = 512;`
constexpr int kNormThreads = 256;
constexpr int kNormMaxBlocks = 1024;  // partial sums: at most this many, summed by one block

enum Dtype { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };  // the harness's dtype codes

template <typename T, typename TG, typename MT>
__global__ void paddle_adamw_reg_kernel(MT beta1, MT beta2, MT epsilon, MT coeff, MT lr_ratio,
                                        MT beta1_pow_, MT beta2_pow_, const MT* moment1,
                                        MT* moment1_out, const MT* moment2, MT* moment2_out,
                                        const MT* lr_, const TG* grad, const T* param, T* param_out,
                                        const MT* master_param, MT* master_param_out, int64_t ndim) {
  MT lr = *lr_ * lr_ratio;
  MT beta1_pow = beta1_pow_;
  MT beta2_pow = beta2_pow_;

  int64_t id = blockIdx.x * blockDim.x + threadIdx.x;

  for (; id < ndim; id += gridDim.x * blockDim.x) {
    MT p = master_param ? master_param[id] : static_cast<MT>(param[id]);
    MT g = static_cast<MT>(grad[id]);
    MT mom1 = static_cast<MT>(moment1[id]);
    MT mom2 = static_cast<MT>(moment2[id]);

    p *= (static_cast<MT>(1.0) - lr * coeff);

    mom1 = beta1 * mom1 + (static_cast<MT>(1.0) - beta1) * g;
    mom2 = beta2 * mom2 + (static_cast<MT>(1.0) - beta2) * g * g;

    MT denom = (sqrt(mom2) / sqrt(static_cast<MT>(1.0) - beta2_pow)) + epsilon;

    p += (mom1 / denom) * (-(lr / (static_cast<MT>(1.0) - beta1_pow)));

    moment1_out[id] = mom1;
    moment2_out[id] = mom2;
    param_out[id] = static_cast<T>(p);
    if (master_param_out) {
      master_param_out[id] = p;
    }
  }
}

template <typename T, typename TG>
void launch_adamw(int64_t n, float beta1, float beta2, float epsilon, float coeff, float lr_ratio,
                  float beta1_pow, float beta2_pow, const float* lr, const void* grad, void* param,
                  float* master, float* moment1, float* moment2, cudaStream_t stream) {
  int blocks = static_cast<int>((n + kAdamwThreads - 1) / kAdamwThreads);
  T* p = static_cast<T*>(param);
  paddle_adamw_reg_kernel<T, TG, float><<<blocks, kAdamwThreads, 0, stream>>>(
      beta1, beta2, epsilon, coeff, lr_ratio, beta1_pow, beta2_pow, moment1, moment1, moment2,
      moment2, lr, static_cast<const TG*>(grad), p, p, master, master, n);
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
