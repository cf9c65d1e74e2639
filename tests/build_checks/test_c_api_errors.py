"""The C layer reports its own errors and layouts, without Paddle or a GPU: the host code
(csrc/kernels/*.cc and cpu/*.cc) is compiled with the host compiler of the build definition,
(1) into a driver that calls every CPU entry point with one argument broken and checks the status
and fastffn_last_error's message, and (2) into a shared library whose struct layout table
(fastffn_abi_*) the GPU harness's ctypes mirrors (paddle_fastffn/torch/c_structs.py) must match."""

import ctypes
import os
from pathlib import Path

import pytest

from paddle_fastffn.ops import build_definition
from paddle_fastffn.torch import c_structs

from build_tools import require_tool, run

DRIVER = Path(__file__).with_name("c_api_errors_driver.cc")
INVALID_ARGUMENT, UNSUPPORTED_DTYPE = 1, 2

# case -> (status, the message fastffn_last_error must give)
EXPECTED = {
    "swiglu_fwd": (INVALID_ARGUMENT, "fastffn_swiglu_fwd_cpu: gate_row_stride (3) and up_row_stride "
                                     "(4) must be >= cols (4)"),
    "swiglu_bwd": (INVALID_ARGUMENT, "fastffn_swiglu_bwd_cpu: the row stride of d_gate (2) must be "
                                     ">= cols (4)"),
    "swiglu_dtype": (UNSUPPORTED_DTYPE, "fastffn_swiglu_fwd_cpu: args.dtype is FP8_E4M3 (4); this "
                                        "kernel stores FLOAT32, FLOAT16, BFLOAT16 or FLOAT64"),
    "rms_norm_fwd": (INVALID_ARGUMENT, "fastffn_rms_norm_fwd_cpu: cols (the normalised width) must "
                                       "be > 0, got 0"),
    "rms_norm_bwd": (INVALID_ARGUMENT, "fastffn_rms_norm_bwd_cpu: epsilon must be a non-negative "
                                       "float, got -1"),
    "rotary": (INVALID_ARGUMENT, "fastffn_rotary_cpu: k heads (2) must divide q heads (3)"),
    "rotary_positions": (INVALID_ARGUMENT, "fastffn_rotary_cpu: position_ids[1] is 7, outside the "
                                           "cos/sin table [0, 4)"),
    "cross_entropy": (INVALID_ARGUMENT, "fastffn_cross_entropy_cpu: row_stride (3) must be >= vocab (4)"),
    "cross_entropy_labels": (INVALID_ARGUMENT, "fastffn_cross_entropy_cpu: labels holds 9 (row 1 of "
                                               "this call), outside the vocabulary [0, 4) and not "
                                               "ignore_index (-100)"),
    "adamw": (UNSUPPORTED_DTYPE, "fastffn_adamw_cpu: grad_dtype is BFLOAT16; it must be the param's "
                                 "dtype (FLOAT16) or FLOAT32"),
    "adamw_pows": (INVALID_ARGUMENT, "fastffn_adamw_update_pows_cpu: beta1_pow and beta2_pow must "
                                     "not be NULL"),
    "ok": (0, ""),
}


@pytest.fixture(scope="module")
def host_objects(tmp_path_factory):
    """The host code of the C API, compiled as the loader compiles it."""
    require_tool(os.environ.get("CXX", "c++"))
    out = tmp_path_factory.mktemp("c_api_host")
    objects = []
    for source in build_definition.host_kernel_sources() + build_definition.cpu_kernel_sources():
        obj = out / f"{source.name}.o"
        run(build_definition.cxx_compile_command(source, obj))
        objects.append(obj)
    return out, objects


def test_every_cpu_entry_point_reports_its_status_and_why(host_objects):
    out, objects = host_objects
    driver_obj, driver = out / "driver.o", out / "driver"
    run(build_definition.cxx_compile_command(DRIVER, driver_obj))
    cxx = os.environ.get("CXX", "c++")
    run([cxx, driver_obj, *objects, *build_definition.LD_FLAGS, "-o", driver])
    lines = run([driver]).stdout.splitlines()
    reported = {}
    for line in lines:
        case, status, message = line.split("\t")
        reported[case] = (int(status), message)
    assert reported == EXPECTED


@pytest.fixture(scope="module")
def host_library(host_objects):
    out, objects = host_objects
    library = out / "libfastffn_host.so"
    cxx = os.environ.get("CXX", "c++")
    run([cxx, "-shared", *objects, *build_definition.LD_FLAGS, "-o", library])
    return ctypes.CDLL(str(library))


def test_the_harness_ctypes_mirrors_match_the_compiled_struct_layouts(host_library):
    layouts = c_structs.library_layouts(host_library)
    assert "fastffn_tensor" in layouts and "fastffn_adamw_args" in layouts
    c_structs.check_abi(host_library)


def test_a_mirror_that_drifted_is_named_with_its_field(host_library):
    class SwappedRmsNormArgs(ctypes.Structure):  # epsilon and dtype swapped: same size
        _fields_ = [("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("dtype", ctypes.c_int),
                    ("epsilon", ctypes.c_float)]

    class ShortCrossEntropyArgs(ctypes.Structure):  # label_error left out
        _fields_ = c_structs.CrossEntropyArgs._fields_[:-1]

    class NarrowColsRmsNormArgs(ctypes.Structure):  # right names and size, epsilon shifted
        _fields_ = [("rows", ctypes.c_int64), ("cols", ctypes.c_int32), ("epsilon", ctypes.c_float),
                    ("dtype", ctypes.c_int64)]

    def check(name, mirror):
        c_structs.check_abi(host_library, {**c_structs.MIRRORS, name: mirror})

    with pytest.raises(c_structs.AbiMismatch, match=r"fastffn_rms_norm_args: fields are "
                                                    r"\['rows', 'cols', 'epsilon', 'dtype'\]"):
        check("fastffn_rms_norm_args", SwappedRmsNormArgs)
    with pytest.raises(c_structs.AbiMismatch, match=r"fastffn_cross_entropy_args: sizeof is 56 bytes "
                                                    r"in the library, 48 in .*ShortCrossEntropyArgs"):
        check("fastffn_cross_entropy_args", ShortCrossEntropyArgs)
    with pytest.raises(c_structs.AbiMismatch, match=r"fastffn_rms_norm_args.epsilon: offset 16 in "
                                                    r"the library, 12 in NarrowColsRmsNormArgs"):
        check("fastffn_rms_norm_args", NarrowColsRmsNormArgs)
    with pytest.raises(c_structs.AbiMismatch, match="fastffn_tensor: the library exports it but "):
        c_structs.check_abi(host_library, {k: v for k, v in c_structs.MIRRORS.items()
                                           if k != "fastffn_tensor"})
