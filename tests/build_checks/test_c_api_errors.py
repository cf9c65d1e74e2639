"""The C layer reports its own errors and layouts, without Paddle or a GPU: the host code
(csrc/kernels/*.cc and cpu/*.cc) is compiled with the host compiler of the build definition,
(1) into a driver that calls every CPU entry point with one argument broken and checks the status
and fastffn_last_error's message, and (2) into a shared library whose struct layout table
(fastffn_abi_*) the GPU harness's ctypes mirrors (paddle_fastffn/torch/c_structs.py) must match."""

import ctypes
import os
import re
from pathlib import Path

import pytest

from paddle_fastffn.ops import build_definition
from paddle_fastffn.torch import c_structs

from build_tools import require_tool, run

DRIVER = Path(__file__).with_name("c_api_errors_driver.cc")
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
    cases = [line.split("\t") for line in run([driver]).stdout.splitlines()]
    wrong = [f"{case}: got ({status}, {message!r}), expected ({want_status}, {want_message!r})"
             for case, status, message, want_status, want_message in cases
             if (int(status), message) != (int(want_status), want_message)]
    assert not wrong, "\n".join(wrong)
    assert cases[-1][0] == "ok" and len({case[0] for case in cases}) == len(cases)


def test_the_driver_calls_every_cpu_entry_point_the_headers_declare():
    include = build_definition.include_dirs()[0] / "fastffn"
    declared = {name for header in include.glob("*.h")
                for name in re.findall(r"\b(fastffn_\w+_cpu)\(", header.read_text())}
    called = set(re.findall(r"\b(fastffn_\w+_cpu)\(", DRIVER.read_text()))
    assert declared and not declared - called, f"not called by {DRIVER.name}: {sorted(declared - called)}"


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


def test_two_libraries_loaded_side_by_side_each_export_the_whole_table(host_library, tmp_path):
    """The rows are registered when a library loads (csrc/kernels/abi.h): a second copy (as the
    rotary sweep loads several builds), even beside one loaded with RTLD_GLOBAL, fills its own."""
    first = ctypes.CDLL(host_library._name, mode=ctypes.RTLD_GLOBAL)
    copy = tmp_path / "libfastffn_host_copy.so"
    copy.write_bytes(Path(host_library._name).read_bytes())
    second = ctypes.CDLL(str(copy))
    assert c_structs.library_layouts(second) == c_structs.library_layouts(first)
    c_structs.check_abi(second)


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
