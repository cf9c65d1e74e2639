// cuBLASLt GEMM provider of the FP8 path (contract in fastffn/scaled_tensor.h): row-major
// D[M, N] = alpha * op(A) op(B)^T (+ D) on the caller's stream, FP8 or 16-bit inputs, fp32
// accumulation. The Paddle binding and the GPU harness call this same function.
//
// cuBLASLt is not linked. paddlepaddle-gpu and torch ship cuBLAS as pip wheels holding only
// versioned libcublasLt.so.N files, so a link-time -lcublasLt is not reliably available where
// users build; the library is dlopen'ed at first use and the functions below are resolved with
// dlsym. cublasLt.h supplies types, enums and (through decltype) the function signatures only.
//
// Row-major to cuBLASLt's column-major: a row-major [R, C] matrix with row stride ld is the
// column-major [C, R] matrix with leading dimension ld. So D^T[N, M] = op(B) op(A)^T in
// column-major: cuBLASLt's first operand is our b, its second our a, and its (m, n) are our
// (N, M). With K-major a [M, K] and b [N, K] (the Linear layout) that is cuBLASLt's "TN"
// (transa = T, transb = N), the only layout its FP8 kernels take on sm_89/sm_90.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "fastffn/scaled_tensor.h"
#include "../validate.h"

namespace {

// Transformer Engine and PyTorch give cuBLASLt 32 MiB on Hopper: enough for its split-K and
// stream-K kernels at LLaMA shapes.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// Dynamic shapes (variable sequence lengths) keep adding keys; past this the cache starts over.
constexpr size_t kMaxCachedAlgos = 4096;
// Tuning (fastffn_gemm_set_tuning): rounds over the candidates after each one's warm-up run, the
// median of a candidate's rounds deciding; problems tuned per process before new ones take the
// heuristic's choice untimed (variable sequence lengths would otherwise time every new shape);
// most candidates asked of the heuristic.
constexpr int kTuningRounds = 5;
constexpr size_t kMaxTunedProblems = 512;
constexpr int kMaxTuningCandidates = 32;

// Records the message as fastffn_last_error (validate.h's fastffn::fail) under the provider's name.
fastffn_status fail(fastffn_status status, const char* format, ...)
    __attribute__((format(printf, 2, 3)));
fastffn_status fail(fastffn_status status, const char* format, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, format);
  vsnprintf(buffer, sizeof(buffer), format, args);
  va_end(args);
  return fastffn::fail(status, "fastffn_gemm (cuBLASLt provider)", "%s", buffer);
}

// --- cuBLASLt, loaded at first use -----------------------------------------------------------

struct CublasLt {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtGetVersion) get_version = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtGetStatusName) status_name = nullptr;  // optional: error messages only
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) algo_get = nullptr;  // optional: tuning records only
  size_t version = 0;
  std::string path;   // the file or name that was loaded
  std::string error;  // why loading failed ("" when loaded)
};

// The first handle that dlopen gives for `names`, with `flags`; appends failures to `tried`.
void* open_first(const std::vector<std::string>& names, int flags, std::string* tried,
                 std::string* opened) {
  for (const std::string& name : names) {
    if (void* handle = dlopen(name.c_str(), flags)) {
      *opened = name;
      return handle;
    }
    if (!(flags & RTLD_NOLOAD)) {
      const char* why = dlerror();
      *tried += "\n  " + name + ": " + (why ? why : "not found");
    }
  }
  return nullptr;
}

void* open_cublaslt(std::string* opened, std::string* error) {
  const int flags = RTLD_NOW | RTLD_LOCAL;
  std::string tried;
  if (const char* env = std::getenv("FASTFFN_CUBLASLT_PATH"); env != nullptr && *env != '\0') {
    // An explicit choice is the only one tried: silently loading another copy would hide a typo.
    std::vector<std::string> names{env};
    struct stat info;
    if (stat(env, &info) == 0 && S_ISDIR(info.st_mode)) {
      const std::string folder(env);
      names = {folder + "/libcublasLt.so.13", folder + "/libcublasLt.so.12",
               folder + "/libcublasLt.so"};
    }
    if (void* handle = open_first(names, flags, &tried, opened)) return handle;
    *error = "cuBLASLt not loadable from FASTFFN_CUBLASLT_PATH=" + std::string(env) + ":" + tried;
    return nullptr;
  }
  const std::vector<std::string> names{"libcublasLt.so", "libcublasLt.so.13", "libcublasLt.so.12"};
  // A copy already in the process (loaded by Paddle or torch) first: one cuBLASLt per process.
  if (void* handle = open_first(names, flags | RTLD_NOLOAD, &tried, opened)) return handle;
  if (void* handle = open_first(names, flags, &tried, opened)) return handle;
  *error = "cuBLASLt not found by the dynamic loader:" + tried +
           "\nSet FASTFFN_CUBLASLT_PATH to the libcublasLt.so.* file or to its folder (for pip "
           "installs, site-packages/nvidia/cublas/lib or site-packages/nvidia/cu13/lib).";
  return nullptr;
}

template <typename Fn>
bool resolve(void* library, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(library, name));
  if (*fn == nullptr) *missing += std::string(" ") + name;
  return *fn != nullptr;
}

CublasLt load_cublaslt() {
  CublasLt lt;
  void* library = open_cublaslt(&lt.path, &lt.error);
  if (library == nullptr) return lt;
  std::string missing;
  bool ok = true;
  ok &= resolve(library, "cublasLtCreate", &lt.create, &missing);
  ok &= resolve(library, "cublasLtDestroy", &lt.destroy, &missing);
  ok &= resolve(library, "cublasLtGetVersion", &lt.get_version, &missing);
  ok &= resolve(library, "cublasLtMatmulDescCreate", &lt.desc_create, &missing);
  ok &= resolve(library, "cublasLtMatmulDescDestroy", &lt.desc_destroy, &missing);
  ok &= resolve(library, "cublasLtMatmulDescSetAttribute", &lt.desc_set, &missing);
  ok &= resolve(library, "cublasLtMatrixLayoutCreate", &lt.layout_create, &missing);
  ok &= resolve(library, "cublasLtMatrixLayoutDestroy", &lt.layout_destroy, &missing);
  ok &= resolve(library, "cublasLtMatmulPreferenceCreate", &lt.pref_create, &missing);
  ok &= resolve(library, "cublasLtMatmulPreferenceDestroy", &lt.pref_destroy, &missing);
  ok &= resolve(library, "cublasLtMatmulPreferenceSetAttribute", &lt.pref_set, &missing);
  ok &= resolve(library, "cublasLtMatmulAlgoGetHeuristic", &lt.heuristic, &missing);
  ok &= resolve(library, "cublasLtMatmul", &lt.matmul, &missing);
  std::string optional;
  resolve(library, "cublasLtGetStatusName", &lt.status_name, &optional);
  resolve(library, "cublasLtMatmulAlgoConfigGetAttribute", &lt.algo_get, &optional);
  if (!ok) {
    lt.error = lt.path + " lacks" + missing;
    lt.create = nullptr;
    return lt;
  }
  lt.version = lt.get_version();
  return lt;
}

const CublasLt& cublaslt() {
  static const CublasLt lt = load_cublaslt();  // thread-safe one-time initialisation
  return lt;
}

const char* status_name(cublasStatus_t status) {
  const CublasLt& lt = cublaslt();
  return lt.status_name != nullptr ? lt.status_name(status) : "cuBLAS status";
}

#define FASTFFN_CUBLASLT(call)                                                              \
  do {                                                                                      \
    const cublasStatus_t status_ = (call);                                                  \
    if (status_ != CUBLAS_STATUS_SUCCESS)                                                   \
      return fail(FASTFFN_STATUS_LIBRARY_ERROR, "%s failed: %s (%d)", #call,                \
                  status_name(status_), static_cast<int>(status_));                          \
  } while (0)

#define FASTFFN_TRY(call)                                     \
  do {                                                        \
    const fastffn_status try_status_ = (call);                \
    if (try_status_ != FASTFFN_STATUS_OK) return try_status_; \
  } while (0)

// --- one handle and workspace per device --------------------------------------------------------

struct DeviceContext {
  int device = 0;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
};

// The device's handle and workspace, created at its first use and kept for the process.
fastffn_status device_context(int device, DeviceContext* out) {
  static std::mutex mutex;
  static std::unordered_map<int, DeviceContext> contexts;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = contexts.find(device);
  if (found != contexts.end()) {
    *out = found->second;
    return FASTFFN_STATUS_OK;
  }
  const CublasLt& lt = cublaslt();
  DeviceContext context;
  context.device = device;
  FASTFFN_CUBLASLT(lt.create(&context.handle));
  const cudaError_t error = cudaMalloc(&context.workspace, kWorkspaceBytes);
  if (error != cudaSuccess) {
    lt.destroy(context.handle);
    cudaGetLastError();  // not sticky: keep it from surfacing in a later kernel's launch check
    return fail(FASTFFN_STATUS_CUDA_ERROR, "cudaMalloc of the %zu-byte cuBLASLt workspace on "
                "device %d: %s", kWorkspaceBytes, device, cudaGetErrorString(error));
  }
  contexts.emplace(device, context);
  *out = context;
  return FASTFFN_STATUS_OK;
}

fastffn_status loaded() {
  const CublasLt& lt = cublaslt();
  if (lt.create == nullptr) return fail(FASTFFN_STATUS_LIBRARY_MISSING, "%s", lt.error.c_str());
  return FASTFFN_STATUS_OK;
}

// --- argument rules ---------------------------------------------------------------------------

bool is_fp8(fastffn_dtype t) { return t == FASTFFN_DTYPE_FP8_E4M3 || t == FASTFFN_DTYPE_FP8_E5M2; }
bool is_16bit(fastffn_dtype t) { return t == FASTFFN_DTYPE_BFLOAT16 || t == FASTFFN_DTYPE_FLOAT16; }

int64_t element_bytes(fastffn_dtype t) {
  return is_fp8(t) ? 1 : t == FASTFFN_DTYPE_FLOAT32 ? 4 : 2;
}

cudaDataType_t cuda_type(fastffn_dtype t) {
  switch (t) {
    case FASTFFN_DTYPE_FP8_E4M3: return CUDA_R_8F_E4M3;
    case FASTFFN_DTYPE_FP8_E5M2: return CUDA_R_8F_E5M2;
    case FASTFFN_DTYPE_BFLOAT16: return CUDA_R_16BF;
    case FASTFFN_DTYPE_FLOAT16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// Largest power of two (up to 256) dividing the address: cuBLASLt's heuristic otherwise assumes
// 256-byte aligned buffers and may pick a kernel that faults on a view into a larger tensor.
int64_t alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  int64_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

struct Problem {
  int64_t m, n, k;
};

fastffn_status check(const fastffn_tensor& a, const fastffn_tensor& b, const fastffn_tensor& d,
                     const fastffn_gemm_config& config, Problem* problem) {
  const int64_t m = config.transpose_a ? a.cols : a.rows;
  const int64_t k = config.transpose_a ? a.rows : a.cols;
  const int64_t n = config.transpose_b ? b.cols : b.rows;
  const int64_t kb = config.transpose_b ? b.rows : b.cols;
  if (a.rows < 0 || a.cols < 0 || b.rows < 0 || b.cols < 0 || a.row_stride < a.cols ||
      b.row_stride < b.cols || d.row_stride < d.cols)
    return fail(FASTFFN_STATUS_INVALID_ARGUMENT, "negative size, or a row stride below the width");
  if (k != kb || d.rows != m || d.cols != n)
    return fail(FASTFFN_STATUS_INVALID_ARGUMENT,
                "shapes do not chain: A [%lld, %lld], B [%lld, %lld] (after transposes), "
                "D [%lld, %lld]", (long long)m, (long long)k, (long long)n, (long long)kb,
                (long long)d.rows, (long long)d.cols);
  if (d.scale != nullptr || d.scale_inv != nullptr || d.amax != nullptr)
    return fail(FASTFFN_STATUS_INVALID_ARGUMENT,
                "d.scale, d.scale_inv and d.amax are reserved for FP8 outputs: pass NULL");
  if (d.dtype != FASTFFN_DTYPE_BFLOAT16 && d.dtype != FASTFFN_DTYPE_FLOAT16 &&
      d.dtype != FASTFFN_DTYPE_FLOAT32)
    return fail(FASTFFN_STATUS_UNSUPPORTED_DTYPE, "D must be BFLOAT16, FLOAT16 or FLOAT32");
  if (m > 0 && n > 0 && d.data == nullptr)
    return fail(FASTFFN_STATUS_INVALID_ARGUMENT, "d.data is NULL");
  if (m > 0 && n > 0 && k > 0 && (a.data == nullptr || b.data == nullptr))
    return fail(FASTFFN_STATUS_INVALID_ARGUMENT, "a.data or b.data is NULL");
  *problem = {m, n, k};

  if (is_16bit(a.dtype)) {
    if (b.dtype != a.dtype || (d.dtype != a.dtype && d.dtype != FASTFFN_DTYPE_FLOAT32))
      return fail(FASTFFN_STATUS_UNSUPPORTED_DTYPE,
                  "16-bit GEMM: a and b must share one dtype, and D be that dtype or FLOAT32");
    if (a.scale_inv != nullptr || b.scale_inv != nullptr)
      return fail(FASTFFN_STATUS_INVALID_ARGUMENT,
                  "scale_inv given for a 16-bit input: it would be ignored");
    return FASTFFN_STATUS_OK;
  }
  if (!is_fp8(a.dtype) || !is_fp8(b.dtype))
    return fail(FASTFFN_STATUS_UNSUPPORTED_DTYPE,
                "inputs must both be FP8 (E4M3/E5M2) or both BFLOAT16/FLOAT16");
  if (a.dtype == FASTFFN_DTYPE_FP8_E5M2 && b.dtype == FASTFFN_DTYPE_FP8_E5M2)
    return fail(FASTFFN_STATUS_UNSUPPORTED_DTYPE,
                "cuBLASLt has no E5M2 x E5M2 GEMM: one operand must be E4M3");
  if (config.transpose_a || config.transpose_b)
    return fail(FASTFFN_STATUS_INVALID_ARGUMENT,
                "FP8 GEMMs need both operands K-major (a [M, K], b [N, K]; cuBLASLt's TN, its only "
                "FP8 layout on sm_89/sm_90): pass the transposed copy that "
                "fastffn_fp8_quantize_cuda writes (out_t) instead of transpose_a/transpose_b");
  const int64_t d_stride_bytes = d.row_stride * element_bytes(d.dtype);
  if (k % 16 != 0 || a.row_stride % 16 != 0 || b.row_stride % 16 != 0 || d_stride_bytes % 16 != 0)
    return fail(FASTFFN_STATUS_INVALID_ARGUMENT,
                "FP8 GEMM needs K %% 16 == 0 and row strides of a, b, D that are multiples of 16 "
                "bytes (K %lld, strides %lld, %lld, %lld elements)", (long long)k,
                (long long)a.row_stride, (long long)b.row_stride, (long long)d.row_stride);
  if (alignment(a.data) < 16 || alignment(b.data) < 16 || alignment(d.data) < 16)
    return fail(FASTFFN_STATUS_INVALID_ARGUMENT, "FP8 GEMM needs 16-byte aligned a, b and D");
  return FASTFFN_STATUS_OK;
}

// --- descriptors and the heuristic cache --------------------------------------------------------

// RAII for the per-call cuBLASLt descriptors (host objects; creating them costs microseconds).
struct Descriptors {
  const CublasLt& lt;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  explicit Descriptors(const CublasLt& api) : lt(api) {}
  ~Descriptors() {
    if (pref) lt.pref_destroy(pref);
    if (out) lt.layout_destroy(out);
    if (second) lt.layout_destroy(second);
    if (first) lt.layout_destroy(first);
    if (op) lt.desc_destroy(op);
  }
};

template <typename Value>
fastffn_status set(const CublasLt& lt, cublasLtMatmulDesc_t op,
                   cublasLtMatmulDescAttributes_t attribute, const Value& value) {
  FASTFFN_CUBLASLT(lt.desc_set(op, attribute, &value, sizeof(value)));
  return FASTFFN_STATUS_OK;
}

template <typename Value>
fastffn_status prefer(const CublasLt& lt, cublasLtMatmulPreference_t pref,
                      cublasLtMatmulPreferenceAttributes_t attribute, Value value) {
  FASTFFN_CUBLASLT(lt.pref_set(pref, attribute, &value, sizeof(value)));
  return FASTFFN_STATUS_OK;
}

// The operation and the three layouts (C is D) of one call. cuBLASLt's first operand is our b,
// its second our a (see the top of the file).
fastffn_status describe(const fastffn_tensor& a, const fastffn_tensor& b, const fastffn_tensor& d,
                        const fastffn_gemm_config& config, const Problem& p, Descriptors* desc) {
  const CublasLt& lt = desc->lt;
  const cublasOperation_t op_first = config.transpose_b ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op_second = config.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  FASTFFN_CUBLASLT(lt.desc_create(&desc->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  FASTFFN_TRY(set(lt, desc->op, CUBLASLT_MATMUL_DESC_TRANSA, op_first));
  FASTFFN_TRY(set(lt, desc->op, CUBLASLT_MATMUL_DESC_TRANSB, op_second));
  if (is_fp8(a.dtype)) {
    const int8_t fast_accum = config.fast_accum ? 1 : 0;
    FASTFFN_TRY(set(lt, desc->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum));
    // cuBLASLt multiplies its A (our b) and B (our a) by these device scalars: each operand's
    // dequantising scale_inv. NULL leaves cuBLASLt's default of 1.
    if (b.scale_inv != nullptr)
      FASTFFN_TRY(set(lt, desc->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b.scale_inv));
    if (a.scale_inv != nullptr)
      FASTFFN_TRY(set(lt, desc->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a.scale_inv));
  }
  const bool first_t = op_first == CUBLAS_OP_T, second_t = op_second == CUBLAS_OP_T;
  FASTFFN_CUBLASLT(lt.layout_create(&desc->first, cuda_type(b.dtype), first_t ? p.k : p.n,
                                    first_t ? p.n : p.k, b.row_stride));
  FASTFFN_CUBLASLT(lt.layout_create(&desc->second, cuda_type(a.dtype), second_t ? p.m : p.k,
                                    second_t ? p.k : p.m, a.row_stride));
  FASTFFN_CUBLASLT(lt.layout_create(&desc->out, cuda_type(d.dtype), p.n, p.m, d.row_stride));
  return FASTFFN_STATUS_OK;
}

// What the chosen algorithm depends on: device, shape, strides, dtypes, layout, flags, alignment,
// and how many candidates tuning timed (0: the heuristic's first choice).
using AlgoKey = std::array<int64_t, 15>;

struct AlgoKeyHash {
  size_t operator()(const AlgoKey& key) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
    for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

AlgoKey algo_key(int device, const fastffn_tensor& a, const fastffn_tensor& b,
                 const fastffn_tensor& d, const fastffn_gemm_config& config, const Problem& p,
                 int tuning) {
  const int64_t flags = (config.transpose_a != 0) | (config.transpose_b != 0) << 1 |
                        (config.accumulate != 0) << 2 |
                        (is_fp8(a.dtype) && config.fast_accum != 0) << 3 |
                        (a.scale_inv != nullptr) << 4 | (b.scale_inv != nullptr) << 5;
  return {device, p.m, p.n, p.k, a.row_stride, b.row_stride, d.row_stride, a.dtype, b.dtype,
          d.dtype, flags, alignment(a.data), alignment(b.data), alignment(d.data), tuning};
}

// --- tuning: the heuristic's candidates timed on the real operands ------------------------------

// Candidates timed per new problem: 0 takes the heuristic's first choice untimed. Read from
// FASTFFN_GEMM_TUNING at the first GEMM of the process; fastffn_gemm_set_tuning overrides it.
std::atomic<int>& tuning_setting() {
  static std::atomic<int> candidates{[] {
    const char* env = std::getenv("FASTFFN_GEMM_TUNING");
    const int value = env != nullptr ? std::atoi(env) : 0;
    return value > 1 ? std::min(value, kMaxTuningCandidates) : 0;
  }()};
  return candidates;
}

// What tells two algorithms apart in a record: cuBLASLt's algorithm id, tile, stages, split-K
// count and cluster shape (its cublasLtMatmulAlgoConfigAttributes_t; -1 where it does not say).
constexpr int kAlgoConfigFields = 5;
using AlgoConfig = std::array<int64_t, kAlgoConfigFields>;

AlgoConfig unstated() {
  AlgoConfig config;
  config.fill(-1);
  return config;
}

AlgoConfig algo_config(const CublasLt& lt, const cublasLtMatmulAlgo_t& algo) {
  AlgoConfig config = unstated();
  if (lt.algo_get == nullptr) return config;
  const cublasLtMatmulAlgoConfigAttributes_t attributes[kAlgoConfigFields] = {
      CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
      CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
  for (int i = 0; i < kAlgoConfigFields; ++i) {
    uint64_t value = 0;  // the attributes are 2- or 4-byte integers: ask for the size, then read
    size_t size = 0;
    if (lt.algo_get(&algo, attributes[i], nullptr, 0, &size) != CUBLAS_STATUS_SUCCESS ||
        size == 0 || size > sizeof(value))
      continue;
    size_t written = 0;
    if (lt.algo_get(&algo, attributes[i], &value, size, &written) == CUBLAS_STATUS_SUCCESS)
      config[i] = size == 2 ? static_cast<int64_t>(static_cast<uint16_t>(value))
                            : static_cast<int64_t>(static_cast<int32_t>(value));
  }
  return config;
}

struct TuningRecord {
  AlgoKey key;
  AlgoConfig first_config = unstated(), chosen_config = unstated();
  int timed = 0;        // candidates that ran (a candidate cuBLASLt refuses at launch is skipped)
  int chosen = 0;       // the winner's rank in the heuristic's order (0: its first choice)
  float first_ms = 0;   // median time of the heuristic's first choice
  float chosen_ms = 0;  // median time of the winner
};

std::mutex& tuning_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::vector<TuningRecord>& tuning_records() {
  static std::vector<TuningRecord> records;
  return records;
}

// What one tuning run of a problem needs: the call's operands and stream, and where its timed
// runs write (D itself when beta is 0, since the real call overwrites it; otherwise a scratch D
// that the runs write while reading D as C, so D keeps its value for the real accumulation).
struct TuningCall {
  const fastffn_tensor& a;
  const fastffn_tensor& b;
  const fastffn_tensor& d;
  float alpha, beta;
  cublasLtHandle_t handle;
  void* workspace;
  cudaStream_t stream;
};

// Times `candidates` (heuristic order) round-robin on the call's stream; *chosen gets the index of
// the fastest by its median, with the record. Any CUDA failure here leaves *chosen at 0 (the
// heuristic's first choice, what an untuned call runs) and clears the error: tuning never fails
// a GEMM that would run untuned.
void time_candidates(const TuningCall& call, Descriptors* desc,
                     const std::vector<cublasLtMatmulHeuristicResult_t>& candidates, TuningRecord* record,
                     int* chosen) {
  const CublasLt& lt = desc->lt;
  *chosen = 0;
  const int count = static_cast<int>(candidates.size());
  if (count == 0) return;
  void* out = call.d.data;
  bool scratch = false;
  if (call.beta != 0.f) {
    const size_t bytes = static_cast<size_t>(call.d.rows) * call.d.row_stride *
                         element_bytes(call.d.dtype);
    if (cudaMallocAsync(&out, bytes, call.stream) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    scratch = true;
  }
  std::vector<cudaEvent_t> events(static_cast<size_t>(count) * kTuningRounds * 2, nullptr);
  bool ok = true;
  for (cudaEvent_t& event : events) ok = ok && cudaEventCreate(&event) == cudaSuccess;
  std::vector<bool> runs(count, ok);
  auto launch = [&](int i) {
    return lt.matmul(call.handle, desc->op, &call.alpha, call.b.data, desc->first, call.a.data,
                     desc->second, &call.beta, call.d.data, desc->out, out, desc->out,
                     &candidates[i].algo, call.workspace, kWorkspaceBytes, call.stream) ==
           CUBLAS_STATUS_SUCCESS;
  };
  for (int i = 0; i < count && ok; ++i) runs[i] = launch(i);  // warm-up; refusals drop out
  for (int round = 0; round < kTuningRounds && ok; ++round) {
    for (int i = 0; i < count; ++i) {
      if (!runs[i]) continue;
      cudaEvent_t* pair = &events[(static_cast<size_t>(round) * count + i) * 2];
      cudaEventRecord(pair[0], call.stream);
      runs[i] = launch(i);
      cudaEventRecord(pair[1], call.stream);
    }
  }
  // Freed before the wait, so the pool can release it at that synchronisation: the scratch (up to
  // D's size, 2 GiB for an fp32 [4096, 128256]) is held outside the framework's allocator.
  if (scratch) cudaFreeAsync(out, call.stream);
  std::vector<float> medians(count, -1.f);
  if (ok && cudaStreamSynchronize(call.stream) == cudaSuccess) {
    for (int i = 0; i < count; ++i) {
      if (!runs[i]) continue;
      std::vector<float> times(kTuningRounds);
      for (int round = 0; round < kTuningRounds; ++round) {
        cudaEvent_t* pair = &events[(static_cast<size_t>(round) * count + i) * 2];
        if (cudaEventElapsedTime(&times[round], pair[0], pair[1]) != cudaSuccess) runs[i] = false;
      }
      if (!runs[i]) continue;
      std::nth_element(times.begin(), times.begin() + kTuningRounds / 2, times.end());
      medians[i] = times[kTuningRounds / 2];
      record->timed += 1;
    }
  }
  for (cudaEvent_t event : events)
    if (event != nullptr) cudaEventDestroy(event);
  cudaGetLastError();  // tuning started with no error pending (find_algorithm): this one is its own
  if (medians[0] < 0.f) return;  // the first choice did not run: keep it, as untuned calls do
  for (int i = 1; i < count; ++i)
    if (medians[i] >= 0.f && medians[i] < medians[*chosen]) *chosen = i;
  record->first_ms = medians[0];
  record->chosen = *chosen;
  record->chosen_ms = medians[*chosen];
  record->first_config = algo_config(lt, candidates[0].algo);
  record->chosen_config = algo_config(lt, candidates[*chosen].algo);
}

// The algorithm for `desc`, cached per key (a small map behind a mutex; the heuristic query and any
// tuning run unlocked, so two threads may both resolve a new key once): the heuristic's first
// choice, or with tuning (key[14] candidates) the fastest of its candidates timed on this call.
fastffn_status find_algorithm(const AlgoKey& key, const TuningCall& call, Descriptors* desc,
                              cublasLtMatmulAlgo_t* algo) {
  static std::mutex mutex;
  // Untuned choices (cleared when full: dynamic shapes keep adding keys) and tuned winners (never
  // cleared: at most kMaxTunedProblems, each paid for with timing runs and a synchronisation).
  static std::unordered_map<AlgoKey, cublasLtMatmulAlgo_t, AlgoKeyHash> cache, tuned;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto* map : {&tuned, &cache}) {
      auto found = map->find(key);
      if (found != map->end()) {
        *algo = found->second;
        return FASTFFN_STATUS_OK;
      }
    }
  }
  const CublasLt& lt = desc->lt;
  FASTFFN_CUBLASLT(lt.pref_create(&desc->pref));
  // The heuristic assumes 256-byte aligned buffers unless told: give it the real alignments (of
  // our b, our a, and D for both C and D) so that a view into a larger tensor never gets a kernel
  // that needs more.
  const uint32_t align_first = static_cast<uint32_t>(key[12]);
  const uint32_t align_second = static_cast<uint32_t>(key[11]);
  const uint32_t align_d = static_cast<uint32_t>(key[13]);
  FASTFFN_TRY(prefer(lt, desc->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                     uint64_t{kWorkspaceBytes}));
  FASTFFN_TRY(prefer(lt, desc->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_first));
  FASTFFN_TRY(prefer(lt, desc->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_second));
  FASTFFN_TRY(prefer(lt, desc->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d));
  FASTFFN_TRY(prefer(lt, desc->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d));
  const int wanted = key[14] > 1 ? static_cast<int>(key[14]) : 1;
  std::vector<cublasLtMatmulHeuristicResult_t> results(wanted);
  int returned = 0;
  FASTFFN_CUBLASLT(lt.heuristic(call.handle, desc->op, desc->first, desc->second, desc->out,
                                desc->out, desc->pref, wanted, results.data(), &returned));
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
  for (int i = 0; i < returned; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) candidates.push_back(results[i]);
  if (candidates.empty())
    return fail(FASTFFN_STATUS_LIBRARY_ERROR,
                "cuBLASLt found no algorithm for M %lld N %lld K %lld (dtypes a %lld b %lld "
                "d %lld, layout flags %lld, alignments a %lld b %lld d %lld bytes)",
                (long long)key[1], (long long)key[2], (long long)key[3], (long long)key[7],
                (long long)key[8], (long long)key[9], (long long)key[10], (long long)key[11],
                (long long)key[12], (long long)key[13]);
  int chosen = 0;
  bool was_tuned = false;
  if (wanted > 1) {
    bool room = false;
    {
      std::lock_guard<std::mutex> lock(tuning_mutex());
      room = tuning_records().size() < kMaxTunedProblems;
    }
    // A CUDA error left pending by earlier work is the caller's to see: tuning neither clears it
    // nor runs over it (the problem then takes the first choice, uncached, and tunes later).
    const bool error_pending = cudaPeekAtLastError() != cudaSuccess;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    // Timing needs a host wait on the stream, which a stream being captured into a graph forbids.
    bool capturing = false;
    if (!error_pending) {
      capturing = cudaStreamIsCapturing(call.stream, &capture) != cudaSuccess ||
                  capture != cudaStreamCaptureStatusNone;
      cudaGetLastError();  // no error was pending: any now is the query's own
    }
    if (error_pending || capturing) {
      *algo = candidates[0].algo;  // not cached: a later call tunes the problem
      return FASTFFN_STATUS_OK;
    }
    if (room) {
      TuningRecord record;
      record.key = key;
      if (candidates.size() > 1) {
        time_candidates(call, desc, candidates, &record, &chosen);
      } else {  // one candidate: nothing to time, its configuration recorded as both
        record.first_config = record.chosen_config = algo_config(lt, candidates[0].algo);
      }
      std::lock_guard<std::mutex> lock(tuning_mutex());
      tuning_records().push_back(record);
      was_tuned = true;
    }
  }
  *algo = candidates[chosen].algo;
  std::lock_guard<std::mutex> lock(mutex);
  if (was_tuned) {
    tuned.emplace(key, *algo);
    return FASTFFN_STATUS_OK;
  }
  // Past kMaxTunedProblems a tuned key holds the untimed first choice, in the cache that clears.
  if (cache.size() >= kMaxCachedAlgos) cache.clear();
  cache.emplace(key, *algo);
  return FASTFFN_STATUS_OK;
}

fastffn_status zero_output(const fastffn_tensor& d, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(element_bytes(d.dtype));
  const cudaError_t error =
      cudaMemset2DAsync(d.data, d.row_stride * bytes, 0, d.cols * bytes, d.rows, stream);
  if (error != cudaSuccess)
    return fail(FASTFFN_STATUS_CUDA_ERROR, "cudaMemset2DAsync: %s", cudaGetErrorString(error));
  return FASTFFN_STATUS_OK;
}

fastffn_status current_context(DeviceContext* context) {
  FASTFFN_TRY(loaded());
  int device = 0;
  const cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess)
    return fail(FASTFFN_STATUS_CUDA_ERROR, "cudaGetDevice: %s", cudaGetErrorString(error));
  return device_context(device, context);
}

}  // namespace

extern "C" const char* fastffn_gemm_last_error(void) { return fastffn_last_error(); }

extern "C" fastffn_status fastffn_gemm_init_cuda(size_t* cublaslt_version) {
  fastffn::ok();
  DeviceContext context;
  const fastffn_status status = current_context(&context);
  if (status == FASTFFN_STATUS_OK && cublaslt_version != nullptr)
    *cublaslt_version = cublaslt().version;
  return status;
}

extern "C" fastffn_status fastffn_gemm_cuda(fastffn_tensor a, fastffn_tensor b, fastffn_tensor d,
                                            fastffn_gemm_config config, void* stream) {
  fastffn::ok();
  Problem p;
  FASTFFN_TRY(check(a, b, d, config, &p));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.m == 0 || p.n == 0) return FASTFFN_STATUS_OK;
  if (p.k == 0) return config.accumulate ? FASTFFN_STATUS_OK : zero_output(d, s);

  DeviceContext context;
  FASTFFN_TRY(current_context(&context));
  const CublasLt& lt = cublaslt();
  Descriptors desc(lt);
  FASTFFN_TRY(describe(a, b, d, config, p, &desc));
  const float alpha = config.alpha, beta = config.accumulate ? 1.f : 0.f;
  const TuningCall call{a, b, d, alpha, beta, context.handle, context.workspace, s};
  cublasLtMatmulAlgo_t algo;
  FASTFFN_TRY(find_algorithm(
      algo_key(context.device, a, b, d, config, p, tuning_setting().load()), call, &desc, &algo));
  FASTFFN_CUBLASLT(lt.matmul(context.handle, desc.op, &alpha, b.data, desc.first, a.data,
                             desc.second, &beta, d.data, desc.out, d.data, desc.out, &algo,
                             context.workspace, kWorkspaceBytes, s));
  return FASTFFN_STATUS_OK;
}

extern "C" fastffn_status fastffn_gemm_set_tuning(int candidates) {
  fastffn::ok();
  if (candidates < 0 || candidates > kMaxTuningCandidates)
    return fail(FASTFFN_STATUS_INVALID_ARGUMENT,
                "candidates must be 0 or 1 (the heuristic's first choice, untimed) or 2..%d, got %d",
                kMaxTuningCandidates, candidates);
  tuning_setting().store(candidates > 1 ? candidates : 0);
  return FASTFFN_STATUS_OK;
}

extern "C" int fastffn_gemm_get_tuning(void) { return tuning_setting().load(); }

extern "C" int fastffn_gemm_tuning_records(double* rows, int capacity) {
  std::lock_guard<std::mutex> lock(tuning_mutex());
  const std::vector<TuningRecord>& records = tuning_records();
  const int count = static_cast<int>(records.size());
  for (int i = 0; i < count && i < capacity && rows != nullptr; ++i) {
    const TuningRecord& r = records[i];
    double* row = rows + static_cast<size_t>(i) * FASTFFN_GEMM_TUNING_FIELDS;
    const double values[] = {
        double(r.key[1]), double(r.key[2]), double(r.key[3]), double(r.key[7]), double(r.key[8]),
        double(r.key[9]), double(r.key[10]), double(r.key[14]), double(r.timed),
        double(r.chosen), double(r.first_ms), double(r.chosen_ms)};
    static_assert(sizeof(values) / sizeof(double) + 2 * kAlgoConfigFields == FASTFFN_GEMM_TUNING_FIELDS,
                  "a record's row is its fields and the two algorithms' configs");
    double* next = std::copy(std::begin(values), std::end(values), row);
    next = std::copy(r.first_config.begin(), r.first_config.end(), next);
    std::copy(r.chosen_config.begin(), r.chosen_config.end(), next);
  }
  return count;
}
