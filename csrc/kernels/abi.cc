// The table of the C API's struct layouts (fastffn_abi_* in c_api.h): what the compiler made of
// each struct, so that a ctypes mirror that drifted from the header fails on load, naming the
// struct and field, instead of passing shifted arguments to a kernel.
#include <cstddef>

#include "fastffn/c_api.h"
#include "fastffn/optimizer.h"
#include "fastffn/scaled_tensor.h"

namespace {

struct Field {
  const char* name;
  int64_t offset;
};

struct Struct {
  const char* name;
  int64_t size;
  const Field* fields;
  int field_count;
};

#define FASTFFN_FIELD(type, field) Field{#field, static_cast<int64_t>(offsetof(type, field))}

const Field kDeviceLimits[] = {FASTFFN_FIELD(fastffn_device_limits, sm_count),
                               FASTFFN_FIELD(fastffn_device_limits, max_shared_bytes_per_block)};
const Field kSwiglu[] = {
    FASTFFN_FIELD(fastffn_swiglu_args, gate), FASTFFN_FIELD(fastffn_swiglu_args, up),
    FASTFFN_FIELD(fastffn_swiglu_args, rows), FASTFFN_FIELD(fastffn_swiglu_args, cols),
    FASTFFN_FIELD(fastffn_swiglu_args, gate_row_stride),
    FASTFFN_FIELD(fastffn_swiglu_args, up_row_stride), FASTFFN_FIELD(fastffn_swiglu_args, dtype)};
const Field kRmsNorm[] = {
    FASTFFN_FIELD(fastffn_rms_norm_args, rows), FASTFFN_FIELD(fastffn_rms_norm_args, cols),
    FASTFFN_FIELD(fastffn_rms_norm_args, epsilon), FASTFFN_FIELD(fastffn_rms_norm_args, dtype)};
const Field kRmsNormBwdPlan[] = {FASTFFN_FIELD(fastffn_rms_norm_bwd_plan, blocks),
                                 FASTFFN_FIELD(fastffn_rms_norm_bwd_plan, shared_bytes),
                                 FASTFFN_FIELD(fastffn_rms_norm_bwd_plan, shared_partials),
                                 FASTFFN_FIELD(fastffn_rms_norm_bwd_plan, workspace_bytes)};
const Field kHeadsLayout[] = {
    FASTFFN_FIELD(fastffn_heads_layout, token_stride), FASTFFN_FIELD(fastffn_heads_layout, group_stride),
    FASTFFN_FIELD(fastffn_heads_layout, heads_per_group), FASTFFN_FIELD(fastffn_heads_layout, head_stride)};
const Field kRotary[] = {
    FASTFFN_FIELD(fastffn_rotary_args, batch), FASTFFN_FIELD(fastffn_rotary_args, seq),
    FASTFFN_FIELD(fastffn_rotary_args, q_heads), FASTFFN_FIELD(fastffn_rotary_args, k_heads),
    FASTFFN_FIELD(fastffn_rotary_args, head_dim), FASTFFN_FIELD(fastffn_rotary_args, q_in),
    FASTFFN_FIELD(fastffn_rotary_args, k_in), FASTFFN_FIELD(fastffn_rotary_args, v_in),
    FASTFFN_FIELD(fastffn_rotary_args, q_out), FASTFFN_FIELD(fastffn_rotary_args, k_out),
    FASTFFN_FIELD(fastffn_rotary_args, v_out), FASTFFN_FIELD(fastffn_rotary_args, table_rows),
    FASTFFN_FIELD(fastffn_rotary_args, inverse), FASTFFN_FIELD(fastffn_rotary_args, dtype),
    FASTFFN_FIELD(fastffn_rotary_args, position_error)};
const Field kCrossEntropy[] = {
    FASTFFN_FIELD(fastffn_cross_entropy_args, rows), FASTFFN_FIELD(fastffn_cross_entropy_args, vocab),
    FASTFFN_FIELD(fastffn_cross_entropy_args, row_stride),
    FASTFFN_FIELD(fastffn_cross_entropy_args, ignore_index),
    FASTFFN_FIELD(fastffn_cross_entropy_args, grad_scale),
    FASTFFN_FIELD(fastffn_cross_entropy_args, with_grad),
    FASTFFN_FIELD(fastffn_cross_entropy_args, dtype),
    FASTFFN_FIELD(fastffn_cross_entropy_args, label_error)};
const Field kScalar[] = {FASTFFN_FIELD(fastffn_scalar, value), FASTFFN_FIELD(fastffn_scalar, ptr)};
const Field kAdamw[] = {
    FASTFFN_FIELD(fastffn_adamw_args, n), FASTFFN_FIELD(fastffn_adamw_args, param_dtype),
    FASTFFN_FIELD(fastffn_adamw_args, grad_dtype), FASTFFN_FIELD(fastffn_adamw_args, beta1),
    FASTFFN_FIELD(fastffn_adamw_args, beta2), FASTFFN_FIELD(fastffn_adamw_args, epsilon),
    FASTFFN_FIELD(fastffn_adamw_args, coeff), FASTFFN_FIELD(fastffn_adamw_args, lr_ratio),
    FASTFFN_FIELD(fastffn_adamw_args, with_decay), FASTFFN_FIELD(fastffn_adamw_args, lr),
    FASTFFN_FIELD(fastffn_adamw_args, beta1_pow), FASTFFN_FIELD(fastffn_adamw_args, beta2_pow),
    FASTFFN_FIELD(fastffn_adamw_args, grad_scale)};
const Field kAdamwState[] = {
    FASTFFN_FIELD(fastffn_adamw_state, moments), FASTFFN_FIELD(fastffn_adamw_state, moment1),
    FASTFFN_FIELD(fastffn_adamw_state, moment2), FASTFFN_FIELD(fastffn_adamw_state, absmax1),
    FASTFFN_FIELD(fastffn_adamw_state, absmax2), FASTFFN_FIELD(fastffn_adamw_state, master),
    FASTFFN_FIELD(fastffn_adamw_state, compensation)};
const Field kTensor[] = {
    FASTFFN_FIELD(fastffn_tensor, data), FASTFFN_FIELD(fastffn_tensor, dtype),
    FASTFFN_FIELD(fastffn_tensor, rows), FASTFFN_FIELD(fastffn_tensor, cols),
    FASTFFN_FIELD(fastffn_tensor, row_stride), FASTFFN_FIELD(fastffn_tensor, scale),
    FASTFFN_FIELD(fastffn_tensor, scale_inv), FASTFFN_FIELD(fastffn_tensor, amax)};
const Field kGemmConfig[] = {
    FASTFFN_FIELD(fastffn_gemm_config, transpose_a), FASTFFN_FIELD(fastffn_gemm_config, transpose_b),
    FASTFFN_FIELD(fastffn_gemm_config, accumulate), FASTFFN_FIELD(fastffn_gemm_config, fast_accum),
    FASTFFN_FIELD(fastffn_gemm_config, alpha)};

#define FASTFFN_STRUCT(type, fields) \
  Struct{#type, static_cast<int64_t>(sizeof(type)), fields, static_cast<int>(sizeof(fields) / sizeof(Field))}
#define FASTFFN_ENUM(type) Struct{#type, static_cast<int64_t>(sizeof(type)), nullptr, 0}

const Struct kStructs[] = {
    FASTFFN_ENUM(fastffn_dtype),
    FASTFFN_ENUM(fastffn_status),
    FASTFFN_STRUCT(fastffn_device_limits, kDeviceLimits),
    FASTFFN_STRUCT(fastffn_swiglu_args, kSwiglu),
    FASTFFN_STRUCT(fastffn_rms_norm_args, kRmsNorm),
    FASTFFN_STRUCT(fastffn_rms_norm_bwd_plan, kRmsNormBwdPlan),
    FASTFFN_STRUCT(fastffn_heads_layout, kHeadsLayout),
    FASTFFN_STRUCT(fastffn_rotary_args, kRotary),
    FASTFFN_STRUCT(fastffn_cross_entropy_args, kCrossEntropy),
    FASTFFN_STRUCT(fastffn_scalar, kScalar),
    FASTFFN_STRUCT(fastffn_adamw_args, kAdamw),
    FASTFFN_ENUM(fastffn_moments),
    FASTFFN_STRUCT(fastffn_adamw_state, kAdamwState),
    FASTFFN_STRUCT(fastffn_tensor, kTensor),
    FASTFFN_STRUCT(fastffn_gemm_config, kGemmConfig),
};
constexpr int kStructCount = static_cast<int>(sizeof(kStructs) / sizeof(Struct));

const Struct* struct_at(int index) {
  return index >= 0 && index < kStructCount ? &kStructs[index] : nullptr;
}

const Field* field_at(int index, int field) {
  const Struct* s = struct_at(index);
  return s != nullptr && field >= 0 && field < s->field_count ? &s->fields[field] : nullptr;
}

}  // namespace

extern "C" int fastffn_abi_struct_count(void) { return kStructCount; }

extern "C" const char* fastffn_abi_struct_name(int index) {
  const Struct* s = struct_at(index);
  return s != nullptr ? s->name : nullptr;
}

extern "C" int64_t fastffn_abi_struct_size(int index) {
  const Struct* s = struct_at(index);
  return s != nullptr ? s->size : -1;
}

extern "C" int fastffn_abi_field_count(int index) {
  const Struct* s = struct_at(index);
  return s != nullptr ? s->field_count : -1;
}

extern "C" const char* fastffn_abi_field_name(int index, int field) {
  const Field* f = field_at(index, field);
  return f != nullptr ? f->name : nullptr;
}

extern "C" int64_t fastffn_abi_field_offset(int index, int field) {
  const Field* f = field_at(index, field);
  return f != nullptr ? f->offset : -1;
}
