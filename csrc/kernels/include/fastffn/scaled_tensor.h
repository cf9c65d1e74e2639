// paddle_fastffn FP8 C API: scaled tensors, the cuBLASLt GEMM provider, FP8 quantisation
// (cast + transpose + amax) and dequantisation. The device limits the kernels plan with (SM count,
// shared memory, read at run time) are c_api.h's fastffn_device_limits_cuda.
//
// A tensor descriptor carries a device pointer, a dtype, a row-major 2-D shape with a row stride
// and the fp32 device scalars of per-tensor FP8 scaling (scale, scale_inv, amax), in the spirit of
// Transformer Engine's NVTE tensors. Kernels stay framework-neutral: the Paddle bindings and the
// ctypes GPU harness (paddle_fastffn/torch/fp8/c_api.py) call these same functions.
//
// Kept apart from c_api.h while the FP8 path is built (nothing else includes this header); it
// reuses c_api.h's fastffn_dtype (FASTFFN_DTYPE_FP8_E4M3 / _E5M2) and fastffn_status.
//
// Build: gemm.cu includes <cublasLt.h> for its types and enums only and links no cuBLAS library:
// cuBLASLt is dlopen'ed at first use (see fastffn_gemm_init_cuda). The include path of cublasLt.h
// comes from the build definition (paddle_fastffn/ops/build_definition.py): the CUDA toolkit's
// include/ where it ships cuBLAS, else the include/ folder of the nvidia-cublas wheel.
#ifndef FASTFFN_SCALED_TENSOR_H_
#define FASTFFN_SCALED_TENSOR_H_

#include <stddef.h>
#include <stdint.h>

#include "fastffn/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

// The GEMM entry points also return c_api.h's FASTFFN_STATUS_LIBRARY_MISSING (cuBLASLt could not
// be loaded, or lacks a needed function) and FASTFFN_STATUS_LIBRARY_ERROR (cuBLASLt returned an
// error, or its heuristic found no algorithm); fastffn_last_error (c_api.h) says which call and
// why, as it does for every failed entry point here.

// A row-major 2-D tensor on the device. Element [r, c] is at data + (r * row_stride + c) * size.
typedef struct {
  void* data;
  fastffn_dtype dtype;
  int64_t rows;
  int64_t cols;
  int64_t row_stride;  // in elements, >= cols
  // fp32 device scalars of per-tensor FP8 scaling; each may be NULL where an entry point says so.
  float* scale;      // quantised = saturate(round(x * scale)); NULL = 1
  float* scale_inv;  // x ~= quantised * scale_inv, i.e. 1 / scale; NULL = 1
  float* amax;       // max |x| over the values that were quantised
} fastffn_tensor;

// ---------------------------------------------------------------------------------------------
// GEMM (cuBLASLt, on the caller's stream, fp32 accumulation), row-major:
//
//   D[M, N] = alpha * (sa * A[M, K]) @ (sb * B[N, K])^T      (+ D[M, N] when accumulate)
//
//   A = a, stored [M, K]              or, with transpose_a, a^T with a stored [K, M]
//   B = b, stored [N, K]              or, with transpose_b, b^T with b stored [K, N]
//   sa = *a.scale_inv, sb = *b.scale_inv   (FP8 inputs; NULL = 1)
//
// The default layout is a Linear layer with weight [out, in]:  y[T, out] = x[T, in] @ w[out, in]^T
// (a = x, b = w). The backward's GEMMs:
//   dgrad  dx[T, in]   = dy[T, out] @ w    a = dy,   b = w^T [in, out]
//                                          (16-bit also: b = w with transpose_b)
//   wgrad  dw[out, in] = dy^T @ x          a = dy^T [out, T], b = x^T [in, T]
//                                          (16-bit also: a = dy, b = x, transpose_a and _b)
//
// Inputs, one of:
//   16-bit: a and b both BFLOAT16 or both FLOAT16, any layout; D the same dtype or FLOAT32;
//           a.scale_inv and b.scale_inv must be NULL (there is nothing to scale).
//   FP8:    a and b FP8_E4M3 / FP8_E5M2 (not both E5M2: cuBLASLt has no e5m2 x e5m2 kernel,
//           UNSUPPORTED_DTYPE); D BFLOAT16, FLOAT16 or FLOAT32. cuBLASLt runs FP8 on sm_89/sm_90
//           only with both operands K-major ("TN"), so FP8 requires transpose_a = transpose_b = 0:
//           pass the transposed copies fastffn_fp8_quantize_cuda writes (out_t) for dgrad/wgrad.
//           FP8 also requires K % 16 == 0 (for wgrad, K is the token count), a, b and D 16-byte
//           aligned, and a/b/D row strides that are multiples of 16 bytes. Any of these
//           broken: INVALID_ARGUMENT.
// D: d.data [M, N]; d.scale, d.scale_inv and d.amax must be NULL (reserved for FP8 outputs).
// fast_accum (FP8 only, ignored for 16-bit inputs): cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM,
//   which skips the periodic promotion of the tensor cores' partial sums to fp32; faster, less
//   accurate: Transformer Engine uses it for the forward GEMM only.
// accumulate: D += (beta = 1), e.g. the weight gradient summed over micro-batches in fp32.
//
// One cuBLASLt handle and a 32 MiB workspace per device, created at the first call on that
// device (not capturable into a CUDA graph: call fastffn_gemm_init_cuda first). The workspace is
// shared by every call on the device, so GEMMs on one device must be ordered (one stream at a
// time, as Paddle's compute stream is). Algorithms come from cuBLASLt's heuristic, cached per
// (device, shape, strides, dtypes, layout, accumulate, fast_accum, pointer alignment, tuning):
// its first choice, or with tuning on (fastffn_gemm_set_tuning below) the fastest of its
// candidates timed at the problem's first call.
// Returns INVALID_ARGUMENT for shapes or layouts outside the above, LIBRARY_MISSING when cuBLASLt
// cannot be loaded, LIBRARY_ERROR when it fails, CUDA_ERROR for a CUDA runtime failure.
// ---------------------------------------------------------------------------------------------
typedef struct {
  int transpose_a;
  int transpose_b;
  int accumulate;
  int fast_accum;
  float alpha;
} fastffn_gemm_config;

fastffn_status fastffn_gemm_cuda(fastffn_tensor a, fastffn_tensor b, fastffn_tensor d,
                                 fastffn_gemm_config config, void* stream);

// Loads cuBLASLt (once per process) and creates the current device's handle and workspace.
// cuBLASLt is looked up, in order: $FASTFFN_CUBLASLT_PATH (the library file, or a folder such as
// site-packages/nvidia/cublas/lib holding libcublasLt.so.*), a copy already loaded in the process
// (Paddle's or torch's), then libcublasLt.so, libcublasLt.so.13, libcublasLt.so.12 through the
// dynamic loader's search path. *cublaslt_version (may be NULL) gets cublasLtGetVersion().
fastffn_status fastffn_gemm_init_cuda(size_t* cublaslt_version);

// GEMM algorithm tuning, process-wide. candidates 0 (the default) or 1: each problem runs the
// heuristic's first choice, nothing is timed. 2..32: a problem's first call asks the heuristic for
// up to that many candidates and times each on the call's own operands and stream (one warm-up
// run, then 5 round-robin rounds; the median decides), synchronising the stream once; the fastest
// is cached for the problem. A call that accumulates (beta 1) times into a scratch D allocated
// stream-ordered (cudaMallocAsync), so D keeps its value; when that allocation fails, or any CUDA
// call of the timing does, the problem keeps the heuristic's first choice. A stream being captured
// into a CUDA graph is never timed, nor a call made while a CUDA error is pending (both run the
// first choice and leave the problem to a later call). After 512 tuned problems (variable sequence
// lengths add one per new token count) new problems take the heuristic's first choice untimed.
// Each round times one launch per candidate, so a GEMM shorter than a kernel launch is timed with
// the launch in it. The choice depends on timings, so two processes may run different algorithms
// for one problem (results may differ in the last bits). FASTFFN_GEMM_TUNING=<candidates> in the
// environment sets it at the first GEMM of the process (above 32: 32; below 2: off).
// INVALID_ARGUMENT outside 0..32.
fastffn_status fastffn_gemm_set_tuning(int candidates);
int fastffn_gemm_get_tuning(void);

// One row per tuned problem, in the order tuned, FASTFFN_GEMM_TUNING_FIELDS doubles each:
//   M, N, K, a dtype, b dtype, D dtype (fastffn_dtype), layout flags (transpose_a 1, transpose_b 2,
//   accumulate 4, fast_accum 8, a scale_inv 16, b scale_inv 32), candidates asked, candidates
//   timed (0 when timing could not run), the winner's rank in the heuristic's order (0: its first
//   choice), the first choice's median ms, the winner's median ms; then the first choice's and the
//   winner's cuBLASLt configuration, 5 each: algorithm id, tile id, stages id, split-K count,
//   cluster shape id (cublasLtMatmulAlgoConfigAttributes_t; -1 where cuBLASLt does not say; all -1
//   when timing could not run).
// Writes min(count, capacity) rows to `rows` (may be NULL with capacity 0); returns the count.
#define FASTFFN_GEMM_TUNING_FIELDS 22
int fastffn_gemm_tuning_records(double* rows, int capacity);

// fastffn_last_error under its former name: what went wrong in this thread's last failed call (for
// the GEMM: the paths tried, the cuBLASLt call and its status, the broken requirement); "" after a
// successful fastffn_gemm_cuda / fastffn_gemm_init_cuda.
const char* fastffn_gemm_last_error(void);

// ---------------------------------------------------------------------------------------------
// FP8 quantisation, one pass over x [rows, cols] (BFLOAT16, FLOAT16 or FLOAT32):
//
//   q = saturate(round_to_nearest_even(x * scale))       x * scale in fp32, scale = *out.scale
//
// written to out.data ([rows, cols]) and, in the same pass, to out_t.data ([cols, rows], the
// transposed copy that the K-major FP8 GEMMs of dgrad and wgrad need); either may be NULL, both
// NULL computes amax only. out.dtype (and out_t.dtype) is FP8_E4M3 or FP8_E5M2. out also carries:
//   out.scale      read; NULL = 1
//   out.scale_inv  written: 1 / scale, correctly rounded (for the GEMM and dequantisation);
//                  may be NULL
//   out.amax       *amax = max(*amax, max |x|): it accumulates, so chunks may share one amax;
//                  initialise it to 0 (a non-negative float). A NaN in x makes it NaN. May be NULL.
// out_t's scale, scale_inv and amax are not read (NULL, or out's).
// Values (max finite: e4m3 448, e5m2 57344):
//   finite x, |x * scale| above the max (fp32 overflow to Inf included)  -> +-max (saturation)
//   |x * scale| at most half the smallest subnormal (e4m3 2^-10, e5m2 2^-17)  -> +-0
//   x = +-Inf   e5m2: +-Inf (0x7C / 0xFC);  e4m3, which has no Inf: NaN (0x7F)
//   NaN (x, or x * scale, e.g. a NaN scale)                             -> 0x7F (NaN in both)
// Non-finite inputs stay non-finite so the overflow checks of mixed-precision training (found_inf
// in dynamic loss scaling) still see them after the GEMM. This is __nv_cvt_float_to_fp8(...,
// __NV_SATFINITE, ...) except for Inf, which that clamps to +-max, and NaN, whose bits it leaves
// to the hardware (the sm_89+ instruction may keep the sign); here NaN is always 0x7F.
// Any shape and row strides: 16-byte loads and stores where a tensor's pointer and row stride
// allow, element accesses elsewhere. Returns UNSUPPORTED_DTYPE for other dtypes,
// INVALID_ARGUMENT for shapes that do not match or aliased scale / scale_inv / amax pointers.
//
// An FP8 x (FP8_E4M3 / FP8_E5M2) is not quantised again but transposed byte for byte into out_t
// (of x's dtype): an FP8 copy's other layout (a frozen weight's dgrad copy made from its forward
// copy, which the K-major GEMMs need). out.data, out.scale, out.scale_inv and out.amax must then be
// NULL, and out_t.data must not be NULL nor overlap x (INVALID_ARGUMENT otherwise).
// ---------------------------------------------------------------------------------------------
fastffn_status fastffn_fp8_quantize_cuda(fastffn_tensor x, fastffn_tensor out,
                                         fastffn_tensor out_t, void* stream);

// Dequantisation: y[r, c] = round_to(y.dtype, float(q[r, c]) * scale_inv) with
// scale_inv = *q.scale_inv (NULL = 1), fp32 product; q FP8_E4M3 / FP8_E5M2, y BFLOAT16, FLOAT16
// or FLOAT32 of q's shape. NaN -> NaN, e5m2 +-Inf -> +-Inf. fp32 products below 2^-126 flush to
// zero (the kernels are built with --use_fast_math): keep scale_inv above ~2^-100.
fastffn_status fastffn_fp8_dequantize_cuda(fastffn_tensor q, fastffn_tensor y, void* stream);

// ---------------------------------------------------------------------------------------------
// SwiGLU fused with FP8 quantisation (swiglu_fp8.cu): the FFN's activation between the gate_up
// GEMM and the down GEMM (paddle_fastffn/torch/fp8/ffn.py composes the FP8 FFN from these entry points
// and the GEMM above).
//
// Forward, one pass over gate_up [T, 2I] (BFLOAT16, FLOAT16 or FLOAT32, any row stride; row r is
// [gate | up], the layout of the fused gate_up GEMM's output):
//
//   h = silu(g) * u                                 fp32, fastffn_swiglu_fwd_cuda's expression
//   q = saturate(round_to_nearest_even(h * scale))  scale = *out_h.scale (NULL = 1)
//
// written to out_h.data [T, I] (the down GEMM's input) and out_h_t.data [I, T] (the transposed
// copy, K-major for the down projection's wgrad); either may be NULL. out_h.dtype is FP8_E4M3 or
// FP8_E5M2 (out_h_t.dtype the same). out_h also carries:
//   out_h.amax       *amax = max(*amax, max |h|) over all of h, written or not (NULL: skipped);
//                    initialise it to 0. A NaN h makes it NaN.
//   out_h.scale_inv  1 / scale, correctly rounded, when a quantised output is written (may be NULL)
// Values: fastffn_fp8_quantize_cuda's rules with h as its x. An h that overflows fp32 (finite
// inputs whose product exceeds FLT_MAX) is Inf there: e5m2 +-Inf, e4m3 NaN.
//
// out_gate_up: the FP8 copy of gate_up itself that the backward can read instead of the 16-bit
// gate_up (the FFN then keeps 1 byte per element of [T, 2I] for backward, not 2), in the same pass:
//   out_gate_up.data [T, 2I] (any row stride, [gate | up] rows): fastffn_fp8_quantize_cuda of
//                    gate_up with *out_gate_up.scale (NULL = 1), byte for byte; NULL for none
//   out_gate_up.amax *amax = max(*amax, max |gate_up|) (NULL: skipped), written or not
//   out_gate_up.scale_inv  1 / scale when data is written (may be NULL)
// out_gate_up.dtype must be out_h.dtype (the forward format) when data or amax is given; with
// data = amax = NULL it is not read. h is computed from the 16-bit gate_up either way.
//
// Both recipes of per-tensor scaling:
//   delayed  the scale comes from earlier steps (fastffn_fp8_update_amax_history_cuda): one pass,
//            out_h.amax (out_gate_up.amax) = the current slot of the tensor's amax history
//   current  the scale comes from this tensor's own amax, known only after a pass over it:
//            1. out_h.data = out_h_t.data = out_gate_up.data = NULL: the amax-only pass (scales
//               and scale_invs are neither read nor written); it gives h's and gate_up's amax
//            2. fastffn_fp8_compute_scale_cuda(amax -> scale, scale_inv) on the device, per tensor
//            3. the quantising pass with those scales (amax NULL, or the same pointers again)
//            No host synchronisation; the pass reads gate_up twice instead of writing and
//            re-reading a 16-bit h (the same bytes, and no [T, I] buffer).
// Returns UNSUPPORTED_DTYPE for other dtypes, INVALID_ARGUMENT for an odd gate_up.cols, shapes
// that do not match, or aliased scale / scale_inv / amax (across out_h and out_gate_up too).
// ---------------------------------------------------------------------------------------------
fastffn_status fastffn_swiglu_fwd_fp8_cuda(fastffn_tensor gate_up, fastffn_tensor out_h,
                                           fastffn_tensor out_h_t, fastffn_tensor out_gate_up,
                                           void* stream);

// Backward, one pass over gate_up [T, 2I] and d_h [T, I] (d_h BFLOAT16, FLOAT16 or FLOAT32;
// gate_up in d_h's dtype, or the forward's FP8 copy of it), fp32 math with
// fastffn_swiglu_bwd_cuda's expressions, sig = sigmoid(g):
//
//   d_gate = d_h * u * sig * (1 + g * (1 - sig))    d_up = d_h * silu(g)    h = silu(g) * u
//
// gate_up FP8_E4M3 / FP8_E5M2 (out_gate_up of the forward): g and u are the dequantised values,
// float(q) * *gate_up.scale_inv in fp32 (NULL = 1); an FP8 h must then be of gate_up's format.
// With a 16-bit gate_up, h is recomputed bit-identical to the forward's fp32 h; from the FP8 copy
// it is h of the dequantised inputs (within e4m3's rounding of the forward's).
// d_gate_up: FP8 [T, 2I] with [d_gate | d_up] in each row (gate_up's layout), quantised with
//   *d_gate_up.scale; d_gate_up.amax accumulates max(|d_gate|, |d_up|) over all of [T, 2I];
//   d_gate_up.scale_inv as in the forward. d_gate_up.data may be NULL, its dtype is required
//   (FP8_E5M2 for gradients; E4M3 accepted).
// d_gate_up_t: [2I, T] FP8 of d_gate_up's dtype, rows [0, I) d_gate^T and [I, 2I) d_up^T: the
//   K-major copy that the gate_up projection's wgrad needs; NULL for none.
// h: the recomputed forward output, for the down projection's wgrad, one of
//   FP8 (h.dtype FP8_E4M3 / E5M2): quantised with *h.scale (the forward's scale: the bytes are
//     then the ones the forward wrote), h.scale_inv written, h.amax accumulated (each may be
//     NULL); h.data [T, I] and h_t.data [I, T] (the wgrad's K-major copy, h's dtype), each
//     optional;
//   d_h's dtype: h rounded to it (fastffn_swiglu_bwd_cuda's recomputed_out), h.data
//     [T, I]; h_t.data and h's scale, scale_inv and amax must be NULL;
//   nothing: h.data, h_t.data and h.amax all NULL (h.dtype is then not read).
// Current scaling of d_gate_up: the amax-only pass (d_gate_up.data = d_gate_up_t.data = NULL,
// no h), fastffn_fp8_compute_scale_cuda, then the quantising pass.
// Outputs must not overlap the inputs. d_gate_up's and h's scale_inv and amax must be distinct
// from every other of their scalars (the two scales may be one). With d_gate_up_t and h_t both
// given a block holds three 16 KiB tiles in dynamic shared memory (with the opt-in, which every
// sm_80+ device has). Returns UNSUPPORTED_DTYPE / INVALID_ARGUMENT as the forward.
fastffn_status fastffn_swiglu_bwd_fp8_cuda(fastffn_tensor gate_up, fastffn_tensor d_h,
                                           fastffn_tensor d_gate_up, fastffn_tensor d_gate_up_t,
                                           fastffn_tensor h, fastffn_tensor h_t, void* stream);

// ---------------------------------------------------------------------------------------------
// Per-tensor scale updates on the device (one tiny kernel each, no host synchronisation). With
// scaled_max = fmt_max * 2^-margin in fp32 (computed on the host, as Transformer Engine does;
// fmt_max 448 for E4M3, 57344 for E5M2; margin >= 0 leaves headroom for growth):
//
//   scale = scaled_max / amax    (IEEE division) for a finite amax > 0; FLT_MAX if that overflows
//   scale = the previous *scale  for amax 0, negative, Inf or NaN (nothing to learn from)
//   *scale_inv = 1 / scale       (IEEE), when scale_inv is not NULL
//
// which is TE's delayed-scaling update (amax_and_scale_update). Current scaling uses the same
// rule here; TE's current-scaling quantiser returns 1 instead of keeping the previous scale.
// INVALID_ARGUMENT for NULL amax / scale, aliased pointers, or a scaled_max that is not a
// positive normal float.
// ---------------------------------------------------------------------------------------------
fastffn_status fastffn_fp8_compute_scale_cuda(const float* amax, float* scale, float* scale_inv,
                                              float fmt_max, float margin, void* stream);

// Delayed scaling's end of step for one tensor, as TE's amax_and_scale_update. amax_history
// [history_len] fp32: [0] holds the amax of the step that ends (the kernels accumulate into
// &amax_history[0]), the rest the amaxes of the history_len - 1 steps before it. The scale
// follows the rule above with amax = the max over the history (fmaxf: a NaN entry is skipped,
// as in TE) or, with most_recent != 0, amax_history[0]. Then the history rolls by one:
// [len - 1] = the old [0], [i] = the old [i + 1] for 0 < i < len - 1 (the oldest leaves), and
// [0] = 0, the next step's slot. scale and scale_inv must not point into the history.
fastffn_status fastffn_fp8_update_amax_history_cuda(float* amax_history, int64_t history_len,
                                                    int most_recent, float* scale,
                                                    float* scale_inv, float fmt_max, float margin,
                                                    void* stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FASTFFN_SCALED_TENSOR_H_
