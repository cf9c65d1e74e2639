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
//
// Low-memory state (fastffn_adamw_with_state_*): the same update over a described state, for the
// two layouts that take less than fp32 moments and an fp32 master (bf16 parameters: 4 + 4 + 4
// bytes of state per parameter):
//
// 8-bit moments (FASTFFN_MOMENTS_BLOCKWISE_8BIT), as bitsandbytes' and torchao's AdamW8bit store
// them: each moment is one uint8 code per element plus one fp32 absmax per block of
// FASTFFN_ADAMW_QUANT_BLOCK (256) consecutive elements (the last block may be shorter), the value
// being map[code] * absmax. One pass: per block, dequantise both moments, run the fp32 update
// above on every element (the parameter update reads the dequantised moments), take the new
// absmax = max |m| of the block, write code = the nearest map entry to m / absmax (ties: the lower
// code; an all-zero block gets absmax 0 and the code of 0.0). 2 + 2 * 4 / 256 bytes per parameter
// for both moments instead of 8.
//   The maps are bitsandbytes' dynamic maps (create_dynamic_map: signed for m1, unsigned for m2),
//   defined by their formula, evaluated in double and rounded once to fp32: a sign (signed map
//   only), a decade 10^-6 .. 10^0 and a linear fraction within it, i.e. 7 decades of dynamic range
//   with ~2 significant digits, dense near |x| = 1 where large moments live and still non-zero down
//   to 1e-7 of the block's absmax (m2 spans orders of magnitude within a block, which a linear map
//   would flush to 0, making 1 / (sqrt(m2) + eps) explode). The unsigned map spends the sign bit on
//   twice the fractions per decade. Both hold 0.0 and 1.0 (the block's absmax element of m2 is
//   exact); the signed map's most negative value is -0.99297 (bitsandbytes' map has no -1.0), so a
//   block whose largest |m1| is negative stores it 0.7% small.
//   Block size 256: bitsandbytes' and torchao's for 8-bit optimizer states; the absmax costs 1.6% of
//   the codes, and a smaller block follows the local scale of m2 better than a whole tensor. The
//   CUDA kernel gives each warp whole quantisation blocks, so the absmax is a reduction within one
//   warp.
//   NaN in a block's moments makes its absmax NaN (a NaN-propagating max), so the whole block reads
//   NaN afterwards, as an fp32 moment that took a NaN stays NaN.
//
// Compensated weights (compensation != NULL, 16-bit parameters, no master): Kahan summation instead
// of an fp32 master. The update runs on p = float(param[i]) + float(compensation[i]) in fp32, then
// param[i] = round(p) and compensation[i] = round(p - float(param[i])) in param_dtype: the part of
// the update below the parameter's last bit is carried to the next step instead of being lost.
// float(param) + float(compensation) holds 16 significant bits (bf16) of the fp32 master's 24: 2
// bytes per parameter instead of 4. For a pair the kernel wrote, float(param) + float(compensation)
// is exact in fp32 (both are multiples of p's fp32 ulp and their sum is about p), so a master
// reconstructed that way splits again into the same compensation.
//
// The updated parameter's amax (param_amax != NULL): *param_amax = max |param[i]| over the values
// just stored (param_dtype, after rounding), the max taken over the fp32 bit patterns of |x|, as
// fastffn_fp8_quantize's amax pass takes it (so a NaN anywhere makes it NaN, and n = 0 gives 0):
// current scaling's first pass over a weight, folded into the one pass that writes the weight, so
// an FP8 copy of it needs only the quantising pass (paddle_fastffn/core/fp8/weight_cache.py). It
// is written, not max-accumulated: the CUDA entry zeroes it on the stream before the kernel.
//
// Either weight layout combines with either moment layout (master and compensation exclude each
// other). INVALID_ARGUMENT for NULL moments/absmax pointers of the moment layout, absmax pointers
// given for FLOAT32 moments, an unknown moment layout, or master and compensation both given;
// UNSUPPORTED_DTYPE for compensation with a FLOAT32 param.
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

// Elements per absmax of FASTFFN_MOMENTS_BLOCKWISE_8BIT moments: absmax arrays hold
// ceil(n / FASTFFN_ADAMW_QUANT_BLOCK) values.
#define FASTFFN_ADAMW_QUANT_BLOCK 256

typedef enum {
  FASTFFN_MOMENTS_FLOAT32 = 0,         // moment1, moment2: float32 [n]; absmax NULL
  FASTFFN_MOMENTS_BLOCKWISE_8BIT = 1,  // moment1, moment2: uint8 codes [n]; absmax: float32 [blocks]
} fastffn_moments;

// One tensor's optimizer state, updated in place.
typedef struct {
  fastffn_moments moments;
  void* moment1;
  void* moment2;
  float* absmax1;      // the blocks' absmax of moment1 (8-bit moments), else NULL
  float* absmax2;
  float* master;       // fp32 master weights, or NULL
  void* compensation;  // param_dtype Kahan compensation (16-bit params without master), or NULL
  float* param_amax;   // fp32 [1]: set to max |param| after the update, or NULL (below)
} fastffn_adamw_state;

// fastffn_adamw_* is this entry with FLOAT32 moments and no compensation.
fastffn_status fastffn_adamw_with_state_cpu(fastffn_adamw_args args, void* param, const void* grad,
                                            fastffn_adamw_state state);
fastffn_status fastffn_adamw_with_state_cuda(fastffn_adamw_args args, void* param,
                                             const void* grad, fastffn_adamw_state state,
                                             void* stream);

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
