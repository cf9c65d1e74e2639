// paddle_fastffn kernel C API.
//
// Every entry point takes raw pointers, sizes, strides (in elements), a dtype and, for CUDA, a
// cudaStream_t passed as void*. No framework header is included here or in the kernels: the Paddle
// bindings (csrc/paddle) and the standalone GPU harness (benchmarks/gpu, via ctypes) call the same
// functions. All math is fp32 inside, whatever the storage dtype. Beside this header, with their
// own extern "C" blocks: fastffn/optimizer.h (AdamW) and fastffn/scaled_tensor.h (FP8).
#ifndef FASTFFN_C_API_H_
#define FASTFFN_C_API_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Storage dtypes. FP8 values are reserved for the FP8 FFN roadmap (inputs with scale pointers);
// no kernel accepts them yet and every entry point returns FASTFFN_STATUS_UNSUPPORTED_DTYPE for them.
typedef enum {
  FASTFFN_DTYPE_FLOAT32 = 0,
  FASTFFN_DTYPE_FLOAT16 = 1,
  FASTFFN_DTYPE_BFLOAT16 = 2,
  FASTFFN_DTYPE_FLOAT64 = 3,
  FASTFFN_DTYPE_FP8_E4M3 = 4,
  FASTFFN_DTYPE_FP8_E5M2 = 5,
} fastffn_dtype;

typedef enum {
  FASTFFN_STATUS_OK = 0,
  FASTFFN_STATUS_INVALID_ARGUMENT = 1,
  FASTFFN_STATUS_UNSUPPORTED_DTYPE = 2,
  FASTFFN_STATUS_CUDA_ERROR = 3,
  FASTFFN_STATUS_LIBRARY_MISSING = 16,  // a runtime-loaded library (cuBLASLt) is missing
  FASTFFN_STATUS_LIBRARY_ERROR = 17,    // that library failed (see fastffn_gemm_last_error)
} fastffn_status;

const char* fastffn_status_string(fastffn_status status);

// Why this thread's last failed call failed: "<entry point>: <the broken rule, with the values>"
// (every entry point of this header, optimizer.h and scaled_tensor.h records one before it
// returns a status other than OK). Read it right after the failing call; a later call may
// replace or clear it. Callers (the Paddle bindings, the GPU harness) show it with their error and
// do not re-check the rules themselves.
const char* fastffn_last_error(void);

// The layout of this header's structs as this library was compiled, for callers that mirror them
// (the GPU harness's ctypes structures check theirs against it on load): struct `index` in
// [0, fastffn_abi_struct_count()) is named fastffn_abi_struct_name (the C typedef, or an enum
// type whose size is given with no fields), has sizeof fastffn_abi_struct_size, and fields
// [0, fastffn_abi_field_count) with their names and byte offsets. NULL / -1 out of range.
int fastffn_abi_struct_count(void);
const char* fastffn_abi_struct_name(int index);
int64_t fastffn_abi_struct_size(int index);
int fastffn_abi_field_count(int index);
const char* fastffn_abi_field_name(int index, int field);
int64_t fastffn_abi_field_offset(int index, int field);

// ---------------------------------------------------------------------------------------------
// Device limits, read from the device at run time (never assumed: an H200 has 132 SMs and
// 227 KiB of opt-in shared memory per block, an A100 108 and 163 KiB, an L40 142 and 99 KiB).
// Launch plans are pure functions of these numbers (host code, testable without a GPU).
// ---------------------------------------------------------------------------------------------
typedef struct {
  int sm_count;
  int max_shared_bytes_per_block;  // with the opt-in (cudaDevAttrMaxSharedMemoryPerBlockOptin)
} fastffn_device_limits;

// The limits of CUDA device `device` (cached per device after the first query).
fastffn_status fastffn_device_limits_cuda(int device, fastffn_device_limits* limits);

// ---------------------------------------------------------------------------------------------
// SwiGLU: out[r, c] = silu(gate[r, c]) * up[r, c] for r < rows, c < cols.
// Row strides let one entry point serve both layouts: packed [gate | up] rows of width 2*cols
// (gate = x, up = x + cols, both strides 2*cols) and two separate tensors.
// Backward writes d_gate and d_up with their own row strides (packed: into one [rows, 2*cols]
// buffer). If `recomputed_out` is not NULL the backward also writes silu(gate) * up there, so the
// forward need not keep its output alive for the down projection's weight gradient (recompute).
// The backward may run in place: d_gate may alias gate, d_up up, and recomputed_out d_out (each
// element is read before it is written), so the FFN backward needs no buffer beyond its inputs.
// ---------------------------------------------------------------------------------------------
typedef struct {
  const void* gate;
  const void* up;
  int64_t rows;
  int64_t cols;
  int64_t gate_row_stride;
  int64_t up_row_stride;
  fastffn_dtype dtype;
} fastffn_swiglu_args;

fastffn_status fastffn_swiglu_fwd_cpu(fastffn_swiglu_args args, void* out, int64_t out_row_stride);
fastffn_status fastffn_swiglu_bwd_cpu(fastffn_swiglu_args args, const void* d_out,
                                      int64_t d_out_row_stride, void* d_gate,
                                      int64_t d_gate_row_stride, void* d_up,
                                      int64_t d_up_row_stride, void* recomputed_out,
                                      int64_t recomputed_out_row_stride);
fastffn_status fastffn_swiglu_fwd_cuda(fastffn_swiglu_args args, void* out, int64_t out_row_stride,
                                       void* stream);
fastffn_status fastffn_swiglu_bwd_cuda(fastffn_swiglu_args args, const void* d_out,
                                       int64_t d_out_row_stride, void* d_gate,
                                       int64_t d_gate_row_stride, void* d_up,
                                       int64_t d_up_row_stride, void* recomputed_out,
                                       int64_t recomputed_out_row_stride, void* stream);

// ---------------------------------------------------------------------------------------------
// RMSNorm with optional fused residual add (rows x cols, contiguous rows).
//   sum  = round_to_dtype(x + residual)          (only when residual != NULL; written to sum_out)
//   n    = sum * rstd, rstd = 1 / sqrt(mean(sum^2) + epsilon)      fp32
//   out  = round_to_dtype(round_to_dtype(n) * weight)
// which is PaddleNLP's LlamaRMSNorm (fp32 statistics, cast back to the weight dtype before the
// weight multiply). x, residual, weight, out and sum_out share one dtype; rstd is fp32 [rows].
// Backward takes the normalised input (x, or sum for the fused add) and rstd, and writes
//   d_x = rstd * (g - n * mean(g * n)) + d_sum     with g = d_out * weight (fp32)
//   d_weight = sum over rows of d_out * round_to_dtype(n), accumulated in fp32 and written in dtype
// d_sum (the gradient arriving at the residual output) may be NULL. The CUDA backward needs a
// `workspace` of fastffn_rms_norm_bwd_workspace_bytes_cuda(args) bytes (per-block fp32 partial
// weight gradients; -1 if the current device cannot be queried); the CPU one allocates its own.
// Any width works: rows whose fp32 partials fit in a block's shared memory accumulate there, wider
// rows accumulate in the workspace (see fastffn_plan_rms_norm_bwd).
// ---------------------------------------------------------------------------------------------
typedef struct {
  int64_t rows;
  int64_t cols;
  float epsilon;
  fastffn_dtype dtype;
} fastffn_rms_norm_args;

typedef struct {
  int64_t blocks;        // persistent blocks, each reducing a strided set of rows
  int64_t shared_bytes;  // dynamic shared memory per block (0 on the workspace path)
  int shared_partials;   // 1: weight-gradient partials in shared memory; 0: in the workspace
  int64_t workspace_bytes;
} fastffn_rms_norm_bwd_plan;

// The CUDA backward's launch plan on a device with `limits` (host-only, pure).
fastffn_rms_norm_bwd_plan fastffn_plan_rms_norm_bwd(int64_t rows, int64_t cols,
                                                    fastffn_device_limits limits);

fastffn_status fastffn_rms_norm_fwd_cpu(fastffn_rms_norm_args args, const void* x,
                                        const void* residual, const void* weight, void* out,
                                        void* sum_out, float* rstd);
fastffn_status fastffn_rms_norm_bwd_cpu(fastffn_rms_norm_args args, const void* x,
                                        const void* weight, const float* rstd, const void* d_out,
                                        const void* d_sum, void* d_x, void* d_weight);
fastffn_status fastffn_rms_norm_fwd_cuda(fastffn_rms_norm_args args, const void* x,
                                         const void* residual, const void* weight, void* out,
                                         void* sum_out, float* rstd, void* stream);
int64_t fastffn_rms_norm_bwd_workspace_bytes_cuda(fastffn_rms_norm_args args);
fastffn_status fastffn_rms_norm_bwd_cuda(fastffn_rms_norm_args args, const void* x,
                                         const void* weight, const float* rstd, const void* d_out,
                                         const void* d_sum, void* d_x, void* d_weight,
                                         void* workspace, void* stream);

// ---------------------------------------------------------------------------------------------
// Rotary position embedding on q [batch, seq, q_heads, head_dim] and k [batch, seq, k_heads,
// head_dim] (grouped-query attention: k_heads divides q_heads), the math of PaddleNLP's
// apply_rotary_pos_emb:  out = x * cos[p] + rotate_half(x) * sin[p],
// rotate_half(x) = [-x[h:], x[:h]], h = head_dim / 2, p = position_ids[b, s] or s when NULL.
// cos/sin are fp32 tables [table_rows, head_dim]. With inverse != 0 the transposed rotation is
// applied (the backward: d_x = d_out * cos[p] + rotate_half^T(d_out * sin[p])).
// Optionally v [batch, seq, k_heads, head_dim] is copied unchanged in the same pass (v and v_out
// both NULL or both set): PaddleNLP's fused qkv_proj holds q, k and v interleaved per KV group,
//   token = [group 0: q heads 0..G-1 | k head 0 | v head 0] [group 1: ...] ...,  G = q_heads / k_heads,
// so one launch reads q and k from it into dense rotated outputs and v into a dense copy (the
// forward), or writes all of d_qkv from dense d_q, d_k, d_v (the backward): no split, no concat.
// Every tensor's heads are addressed through a fastffn_heads_layout (elements, from the tensor's
// pointer): head i of token t starts at
//   t * token_stride + (i / heads_per_group) * group_stride + (i % heads_per_group) * head_stride
// and its head_dim elements are contiguous. A dense [batch, seq, heads, head_dim] tensor is
// {heads * head_dim, heads * head_dim, heads, head_dim}; in PaddleNLP's interleaved qkv
// (width W = k_heads * (G + 2) * head_dim) q is {W, (G + 2) d, G, d} at offset 0, k is
// {W, (G + 2) d, 1, d} at offset G d, v the same at offset (G + 1) d.
// Position ids outside [0, table_rows) are never read through: with position_error set (an
// int32 where the tensors are, zeroed by the caller; the kernels only ever write 1 to it, so one
// flag can serve many calls and be read once) both entry points write NaN over such tokens' q/k
// outputs and set *position_error = 1. With position_error NULL the CPU entry point returns
// INVALID_ARGUMENT before writing and the CUDA one poisons silently, so NULL is for calls whose
// ids were already checked (the backward) or absent.
// ---------------------------------------------------------------------------------------------
typedef struct {
  int64_t token_stride;
  int64_t group_stride;
  int64_t heads_per_group;  // divides the tensor's heads
  int64_t head_stride;
} fastffn_heads_layout;

typedef struct {
  int64_t batch;
  int64_t seq;
  int64_t q_heads;
  int64_t k_heads;  // also v's heads
  int64_t head_dim;
  fastffn_heads_layout q_in;
  fastffn_heads_layout k_in;
  fastffn_heads_layout v_in;  // ignored when v is NULL
  fastffn_heads_layout q_out;
  fastffn_heads_layout k_out;
  fastffn_heads_layout v_out;  // ignored when v_out is NULL
  int64_t table_rows;
  int inverse;
  fastffn_dtype dtype;
  int32_t* position_error;  // see above
} fastffn_rotary_args;

fastffn_status fastffn_rotary_cpu(fastffn_rotary_args args, const void* q, const void* k,
                                  const void* v, const float* cos, const float* sin,
                                  const int64_t* position_ids, void* q_out, void* k_out,
                                  void* v_out);
fastffn_status fastffn_rotary_cuda(fastffn_rotary_args args, const void* q, const void* k,
                                   const void* v, const float* cos, const float* sin,
                                   const int64_t* position_ids, void* q_out, void* k_out,
                                   void* v_out, void* stream);

// ---------------------------------------------------------------------------------------------
// Cross-entropy over the rows of logits [rows, vocab] (row stride in elements), fused with its
// gradient and written over the logits, so that the fused LM head + loss (ops.linear_cross_entropy)
// needs no second pass and no [tokens, vocab] buffer beyond one chunk. Per row r, y = labels[r]:
//   y == ignore_index:  loss[r] = 0, and (with_grad) the row becomes 0
//   otherwise:          m = max_j x_j,  lse = m + log(sum_j exp(x_j - m)),  loss[r] = lse - x_y
//                       (with_grad) the row becomes (softmax(x) - onehot(y)) * grad_scale when
//                       loss[r] > 0, and 0 when it is not (exactly 0, or NaN): PaddleNLP's
//                       LlamaPretrainingCriterion drops the tokens whose loss is not > 0 from its
//                       mean, and so their gradient.
// grad_scale is 1 / (the number of tokens in the mean) for a mean loss. fp32 math for fp16/bf16/
// fp32 logits (float64 computes in double, CPU only); loss is fp32 [rows]. with_grad = 0 computes
// the loss only and leaves the logits untouched.
// Labels outside [0, vocab) that are not ignore_index: the CPU entry point checks every label
// first and returns INVALID_ARGUMENT without writing anything. On CUDA (labels on the device) such
// rows get a NaN loss and a NaN row, and the kernel sets *label_error to 1 (a device int32 the
// caller zeroes and reads after the launch; NULL = not reported).
// ---------------------------------------------------------------------------------------------
typedef struct {
  int64_t rows;
  int64_t vocab;
  int64_t row_stride;  // >= vocab
  int64_t ignore_index;
  float grad_scale;
  int with_grad;
  fastffn_dtype dtype;    // of the logits
  int32_t* label_error;   // CUDA only, see above
} fastffn_cross_entropy_args;

fastffn_status fastffn_cross_entropy_cpu(fastffn_cross_entropy_args args, void* logits,
                                         const int64_t* labels, float* loss);
fastffn_status fastffn_cross_entropy_cuda(fastffn_cross_entropy_args args, void* logits,
                                          const int64_t* labels, float* loss, void* stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FASTFFN_C_API_H_
