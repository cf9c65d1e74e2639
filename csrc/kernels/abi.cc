// The table of the C API's struct layouts (fastffn_abi_* in c_api.h): what the compiler made of
// each struct, so that a ctypes mirror that drifted from the header fails on load, naming the
// struct and field, instead of passing shifted arguments to a kernel. The rows are registered
// (abi.h): the kernels' argument structs beside their checks in validate.h, the rest here.
#include <vector>

#include "abi.h"
#include "fastffn/c_api.h"
#include "fastffn/scaled_tensor.h"
#include "validate.h"  // the kernels' argument structs register their rows there, beside their checks

namespace fastffn {
namespace abi {
namespace {

struct Struct {
  const char* name;
  int64_t size;
  std::vector<Field> fields;
};

// Filled by the registrations' initializers when the library loads, read only afterwards.
std::vector<Struct>& table() {
  static std::vector<Struct> structs;
  return structs;
}

}  // namespace

bool add(const char* name, int64_t size, std::initializer_list<Field> fields) {
  table().push_back(Struct{name, size, std::vector<Field>(fields)});
  return true;
}

// The structs every entry point shares, and FP8's (scaled_tensor.h: checked in its CUDA code, and
// in the table of host-only builds too).
FASTFFN_ABI_ENUM(fastffn_dtype);
FASTFFN_ABI_ENUM(fastffn_status);
FASTFFN_ABI_STRUCT(fastffn_device_limits, sm_count, max_shared_bytes_per_block);
FASTFFN_ABI_STRUCT(fastffn_tensor, data, dtype, rows, cols, row_stride, scale, scale_inv, amax);
FASTFFN_ABI_STRUCT(fastffn_gemm_config, transpose_a, transpose_b, accumulate, fast_accum, alpha);

namespace {

const Struct* struct_at(int index) {
  return index >= 0 && index < static_cast<int>(table().size()) ? &table()[index] : nullptr;
}

const Field* field_at(int index, int field) {
  const Struct* s = struct_at(index);
  const bool in_range = s != nullptr && field >= 0 && field < static_cast<int>(s->fields.size());
  return in_range ? &s->fields[field] : nullptr;
}

}  // namespace
}  // namespace abi
}  // namespace fastffn

using fastffn::abi::Field;
using fastffn::abi::Struct;
using fastffn::abi::field_at;
using fastffn::abi::struct_at;

extern "C" int fastffn_abi_struct_count(void) { return static_cast<int>(fastffn::abi::table().size()); }

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
  return s != nullptr ? static_cast<int>(s->fields.size()) : -1;
}

extern "C" const char* fastffn_abi_field_name(int index, int field) {
  const Field* f = field_at(index, field);
  return f != nullptr ? f->name : nullptr;
}

extern "C" int64_t fastffn_abi_field_offset(int index, int field) {
  const Field* f = field_at(index, field);
  return f != nullptr ? f->offset : -1;
}
