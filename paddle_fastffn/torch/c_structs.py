"""ctypes mirrors of the C API's structs (csrc/kernels/include/fastffn/*.h), without torch, and
the check of every mirror against the layout table the library exports (fastffn_abi_* in
c_api.h): c_api.py runs it when it loads the library, the CPU build check against a g++ build of
the host code. No torch: the Paddle tests of the C entry points' statuses import these too."""

from __future__ import annotations

import ctypes


class SwigluArgs(ctypes.Structure):
    _fields_ = [("gate", ctypes.c_void_p), ("up", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("cols", ctypes.c_int64), ("gate_row_stride", ctypes.c_int64),
                ("up_row_stride", ctypes.c_int64), ("dtype", ctypes.c_int)]


class RmsNormArgs(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("epsilon", ctypes.c_float),
                ("dtype", ctypes.c_int)]


class DeviceLimits(ctypes.Structure):
    _fields_ = [("sm_count", ctypes.c_int), ("max_shared_bytes_per_block", ctypes.c_int)]


class RmsNormBwdPlan(ctypes.Structure):
    _fields_ = [("blocks", ctypes.c_int64), ("shared_bytes", ctypes.c_int64),
                ("shared_partials", ctypes.c_int), ("workspace_bytes", ctypes.c_int64)]


class HeadsLayout(ctypes.Structure):  # fastffn_heads_layout
    _fields_ = [("token_stride", ctypes.c_int64), ("group_stride", ctypes.c_int64),
                ("heads_per_group", ctypes.c_int64), ("head_stride", ctypes.c_int64)]


class RotaryArgs(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("seq", ctypes.c_int64), ("q_heads", ctypes.c_int64),
                ("k_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("q_in", HeadsLayout), ("k_in", HeadsLayout), ("v_in", HeadsLayout),
                ("q_out", HeadsLayout), ("k_out", HeadsLayout), ("v_out", HeadsLayout),
                ("table_rows", ctypes.c_int64), ("inverse", ctypes.c_int), ("dtype", ctypes.c_int),
                ("position_error", ctypes.c_void_p)]


class CrossEntropyArgs(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("vocab", ctypes.c_int64), ("row_stride", ctypes.c_int64),
                ("ignore_index", ctypes.c_int64), ("grad_scale", ctypes.c_float), ("with_grad", ctypes.c_int),
                ("dtype", ctypes.c_int), ("label_error", ctypes.c_void_p)]


class Scalar(ctypes.Structure):
    """fastffn_scalar: `value`, or the fp32 at address `ptr` when it is not NULL."""
    _fields_ = [("value", ctypes.c_float), ("ptr", ctypes.c_void_p)]


class AdamwArgs(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int64), ("param_dtype", ctypes.c_int), ("grad_dtype", ctypes.c_int),
                ("beta1", ctypes.c_float), ("beta2", ctypes.c_float), ("epsilon", ctypes.c_float),
                ("coeff", ctypes.c_float), ("lr_ratio", ctypes.c_float), ("with_decay", ctypes.c_int),
                ("lr", Scalar), ("beta1_pow", Scalar), ("beta2_pow", Scalar), ("grad_scale", Scalar)]


class Tensor(ctypes.Structure):
    """fastffn_tensor (fastffn/scaled_tensor.h)."""
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("rows", ctypes.c_int64),
                ("cols", ctypes.c_int64), ("row_stride", ctypes.c_int64),
                ("scale", ctypes.c_void_p), ("scale_inv", ctypes.c_void_p), ("amax", ctypes.c_void_p)]


class GemmConfig(ctypes.Structure):
    _fields_ = [("transpose_a", ctypes.c_int), ("transpose_b", ctypes.c_int),
                ("accumulate", ctypes.c_int), ("fast_accum", ctypes.c_int), ("alpha", ctypes.c_float)]


# C type name -> its mirror; enums are passed as ctypes.c_int.
MIRRORS = {
    "fastffn_dtype": ctypes.c_int,
    "fastffn_status": ctypes.c_int,
    "fastffn_device_limits": DeviceLimits,
    "fastffn_swiglu_args": SwigluArgs,
    "fastffn_rms_norm_args": RmsNormArgs,
    "fastffn_rms_norm_bwd_plan": RmsNormBwdPlan,
    "fastffn_heads_layout": HeadsLayout,
    "fastffn_rotary_args": RotaryArgs,
    "fastffn_cross_entropy_args": CrossEntropyArgs,
    "fastffn_scalar": Scalar,
    "fastffn_adamw_args": AdamwArgs,
    "fastffn_tensor": Tensor,
    "fastffn_gemm_config": GemmConfig,
}


class AbiMismatch(RuntimeError):
    """A ctypes mirror disagrees with the loaded library's struct layout."""


def library_layouts(lib: ctypes.CDLL) -> dict[str, tuple[int, list[tuple[str, int]]]]:
    """{C type name: (sizeof, [(field, byte offset), ...])} from the library's fastffn_abi_* table."""
    lib.fastffn_abi_struct_count.restype = ctypes.c_int
    lib.fastffn_abi_struct_name.restype = ctypes.c_char_p
    lib.fastffn_abi_struct_name.argtypes = [ctypes.c_int]
    lib.fastffn_abi_struct_size.restype = ctypes.c_int64
    lib.fastffn_abi_struct_size.argtypes = [ctypes.c_int]
    lib.fastffn_abi_field_count.restype = ctypes.c_int
    lib.fastffn_abi_field_count.argtypes = [ctypes.c_int]
    lib.fastffn_abi_field_name.restype = ctypes.c_char_p
    lib.fastffn_abi_field_name.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.fastffn_abi_field_offset.restype = ctypes.c_int64
    lib.fastffn_abi_field_offset.argtypes = [ctypes.c_int, ctypes.c_int]
    layouts = {}
    for i in range(lib.fastffn_abi_struct_count()):
        fields = [(lib.fastffn_abi_field_name(i, j).decode(), lib.fastffn_abi_field_offset(i, j))
                  for j in range(lib.fastffn_abi_field_count(i))]
        layouts[lib.fastffn_abi_struct_name(i).decode()] = (lib.fastffn_abi_struct_size(i), fields)
    return layouts


def check_abi(lib: ctypes.CDLL, mirrors: dict | None = None) -> None:
    """Raises AbiMismatch naming the struct (and field) where a mirror and the library differ:
    a C struct without a mirror or the reverse, sizeof, the field names in order, or an offset."""
    mirrors = MIRRORS if mirrors is None else mirrors
    layouts = library_layouts(lib)
    for name in sorted(set(layouts) ^ set(mirrors)):
        where = "the library exports it but paddle_fastffn/torch/c_structs.py has no mirror" \
            if name in layouts else "c_structs.py mirrors it but the library does not export it"
        raise AbiMismatch(f"{name}: {where}")
    for name, (size, fields) in layouts.items():
        mirror = mirrors[name]
        if ctypes.sizeof(mirror) != size:
            raise AbiMismatch(f"{name}: sizeof is {size} bytes in the library, "
                              f"{ctypes.sizeof(mirror)} in its ctypes mirror {mirror.__name__}")
        if not fields:
            continue
        mirrored = [field[0] for field in mirror._fields_]
        if mirrored != [field for field, _ in fields]:
            raise AbiMismatch(f"{name}: fields are {[f for f, _ in fields]} in the library, "
                              f"{mirrored} in its ctypes mirror {mirror.__name__}")
        for field, offset in fields:
            if getattr(mirror, field).offset != offset:
                raise AbiMismatch(f"{name}.{field}: offset {offset} in the library, "
                                  f"{getattr(mirror, field).offset} in {mirror.__name__}")
