// paddle_fastffn optimizer C API: AdamW with Paddle's semantics, one pass over memory per tensor.
//
// Beside c_api.h (whose dtypes and statuses it uses), as scaled_tensor.h is: the Paddle binding
// (csrc/paddle/adamw_op.cc) and the GPU harness (paddle_fastffn/torch/c_api.py, via ctypes) call these
// same functions.
//
// One call updates ONE tensor of n elements in place, as Paddle's adamw kernel does
// (paddle/phi/kernels/gpu/adamw_kernel.cu, AdamWKernelREG/MEM), in fp32 for every storage dtype:
//
//   lr    = lr * lr_ratio
//   p     = master ? master[i] : float(param[i])
//   g     = float(grad[i]) * grad_scale                  (grad_scale: the global-norm clip)
//   p    *= 1 - lr * (with_decay ? coeff : 0)           (decoupled weight decay)
//   m1    = beta1 * m1 + (1 - beta1) * g
//   m2    = beta2 * m2 + (1 - beta2) * g * g
//   denom = sqrt(m2) / sqrt(1 - beta2_pow) + epsilon
//   p    += (m1 / denom) * (-(lr / (1 - beta1_pow)))
//   master[i] = p (when given);  param[i] = round_to_param_dtype(p)
//
// sqrt and the divisions are IEEE round-to-nearest on both devices, as in Paddle's CUDA build
// (ours compiles with --use_fast_math, so the CUDA kernel names the _rn intrinsics), in the same
// order. NaN or Inf in the gradient propagates into m1, m2 and the parameter, as in Paddle (no
// step is skipped: Paddle's dygraph skips a whole step on found_inf before any kernel runs).
// Traffic for bf16 parameters with fp32 masters: grad 2 + master 4 + m1 4 + m2 4 bytes read,
// master, m1, m2 and param (14 bytes) written: 28 bytes per parameter; the parameter itself is
// not read when a master is given.
//
// Tensors (contiguous, n elements each, none aliasing another):
//   param    param_dtype (FLOAT32, FLOAT16 or BFLOAT16), updated in place
//   grad     grad_dtype: param_dtype, or FLOAT32 (Paddle's fp32 "master gradients")
//   master   fp32 master weights, updated in place; NULL: p is read from param (Paddle without
//            multi_precision, and fp32 parameters)
//   moment1, moment2  fp32, updated in place
// Any alignment: the CUDA kernel moves 16-byte vectors when every pointer is 16-byte aligned and
// runs a scalar path otherwise.
//
// Beta powers: beta1_pow = beta1^t at step t (t from 1). Paddle keeps them per parameter, starting
// at beta1 / beta2, and multiplies them by beta1 / beta2 after that parameter's update:
// fastffn_adamw_update_pows_* does that multiplication (fp32), separately, so that the element
// kernel never writes a value its other threads read.
//
// Statuses: INVALID_ARGUMENT for a NULL tensor pointer or n < 0; UNSUPPORTED_DTYPE for a param
// dtype outside FLOAT32/FLOAT16/BFLOAT16 or a grad dtype other than param_dtype and FLOAT32.
#ifndef FASTFFN_OPTIMIZER_H_
#define FASTFFN_OPTIMIZER_H_

#include <stdint.h>

#include "fastffn/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

// An fp32 scalar that the kernel reads when it runs: *ptr when ptr is not NULL, else value.
// For the CUDA entry points ptr is device memory (Paddle's learning-rate tensor, a clip
// coefficient computed on the GPU): nothing waits on the host, and a captured CUDA graph replays
// with the value current at replay. For the CPU entry points ptr is host memory.
typedef struct {
  float value;
  const float* ptr;
} fastffn_scalar;

typedef struct {
  int64_t n;
  fastffn_dtype param_dtype;
  fastffn_dtype grad_dtype;
  float beta1;
  float beta2;
  float epsilon;
  float coeff;     // weight decay (Paddle's `coeff`), applied only when with_decay != 0
  float lr_ratio;  // Paddle's per-parameter lr_ratio(param); 1 without one
  int with_decay;  // Paddle's apply_decay_param_fun(param.name)
  fastffn_scalar lr;
  fastffn_scalar beta1_pow;
  fastffn_scalar beta2_pow;
  fastffn_scalar grad_scale;  // multiplies the gradient; {1, NULL} for none
} fastffn_adamw_args;

fastffn_status fastffn_adamw_cpu(fastffn_adamw_args args, void* param, const void* grad,
                                 float* master, float* moment1, float* moment2);
fastffn_status fastffn_adamw_cuda(fastffn_adamw_args args, void* param, const void* grad,
                                  float* master, float* moment1, float* moment2, void* stream);

// Paddle's beta-power update after a step: *beta1_pow *= beta1, *beta2_pow *= beta2 (fp32; host
// pointers for _cpu, device pointers for _cuda, one thread on the stream). INVALID_ARGUMENT for a
// NULL pointer.
fastffn_status fastffn_adamw_update_pows_cpu(float beta1, float beta2, float* beta1_pow,
                                             float* beta2_pow);
fastffn_status fastffn_adamw_update_pows_cuda(float beta1, float beta2, float* beta1_pow,
                                              float* beta2_pow, void* stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FASTFFN_OPTIMIZER_H_
