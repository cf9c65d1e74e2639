// The C API's struct layout table (fastffn_abi_* in c_api.h) is filled by registrations: each
// struct's row, what the compiler made of it, stands beside the code that checks it (validate.h
// for the kernels' argument structs, abi.cc for the shared and FP8 ones), so a new op adds its row
// where it adds its argument check. A row registered from a header is an inline variable (C++17):
// one row per library, however many translation units include the header. Hidden, so that it is
// one per library and not one per process: a default-visibility inline variable's guard is a
// process-wide (GNU unique) symbol, and a second library loaded beside the first (the rotary
// sweep's builds) would find its rows already initialised and export an empty table.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <initializer_list>

namespace fastffn {
namespace abi {

struct Field {
  const char* name;
  int64_t offset;
};

// Appends a struct (or, with no fields, an enum type) to the table; true, for an initializer.
// Hidden: this library's table, even where another one was loaded with RTLD_GLOBAL.
__attribute__((visibility("hidden"))) bool add(const char* name, int64_t size,
                                             std::initializer_list<Field> fields);

}  // namespace abi
}  // namespace fastffn

// FASTFFN_ABI_STRUCT(fastffn_foo_args, a, b, c): the struct's fields, every one, in order (at most 16).
#define FASTFFN_ABI_STRUCT(type, ...)                                                               \
  FASTFFN_ABI_ROW(type) = ::fastffn::abi::add(                                                      \
      #type, static_cast<int64_t>(sizeof(type)), {FASTFFN_ABI_FIELDS(type, __VA_ARGS__)})
// An enum type: its size only (the mirrors pass enums as int).
#define FASTFFN_ABI_ENUM(type) \
  FASTFFN_ABI_ROW(type) = ::fastffn::abi::add(#type, static_cast<int64_t>(sizeof(type)), {})
#define FASTFFN_ABI_ROW(type) inline const bool fastffn_abi_row_##type __attribute__((visibility("hidden")))

// FASTFFN_ABI_FIELDS(type, a, b) -> FASTFFN_ABI_FIELD(type, a), FASTFFN_ABI_FIELD(type, b): one
// macro per field count, picked by counting the arguments.
#define FASTFFN_ABI_FIELD(type, field) \
  ::fastffn::abi::Field{#field, static_cast<int64_t>(offsetof(type, field))}
#define FASTFFN_ABI_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, \
                         name, ...)                                                            \
  name
#define FASTFFN_ABI_FIELDS(type, ...)                                                          \
  FASTFFN_ABI_PICK(__VA_ARGS__, FASTFFN_ABI_FIELDS_16, FASTFFN_ABI_FIELDS_15,                 \
                   FASTFFN_ABI_FIELDS_14, FASTFFN_ABI_FIELDS_13, FASTFFN_ABI_FIELDS_12,        \
                   FASTFFN_ABI_FIELDS_11, FASTFFN_ABI_FIELDS_10, FASTFFN_ABI_FIELDS_9,         \
                   FASTFFN_ABI_FIELDS_8, FASTFFN_ABI_FIELDS_7, FASTFFN_ABI_FIELDS_6,           \
                   FASTFFN_ABI_FIELDS_5, FASTFFN_ABI_FIELDS_4, FASTFFN_ABI_FIELDS_3,           \
                   FASTFFN_ABI_FIELDS_2, FASTFFN_ABI_FIELDS_1)(type, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_1(t, f) FASTFFN_ABI_FIELD(t, f)
#define FASTFFN_ABI_FIELDS_2(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_1(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_3(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_2(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_4(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_3(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_5(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_4(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_6(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_5(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_7(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_6(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_8(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_7(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_9(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_8(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_10(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_9(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_11(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_10(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_12(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_11(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_13(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_12(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_14(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_13(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_15(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_14(t, __VA_ARGS__)
#define FASTFFN_ABI_FIELDS_16(t, f, ...) FASTFFN_ABI_FIELD(t, f), FASTFFN_ABI_FIELDS_15(t, __VA_ARGS__)
