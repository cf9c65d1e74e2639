"""CI compiles what users build on GPUs: the CUDA kernels for every architecture of the build
definition (no register spills), and the Paddle bindings with PADDLE_WITH_CUDA against the CPU
wheel's headers, with every kernel symbol they reference defined. The compile commands come from
paddle_fastffn/ops/build_definition.py, the definition the loader and the GPU harness use."""

import re
import subprocess
import sys

import pytest

from paddle_fastffn.ops import build_definition

from build_tools import cuda_math_headers, require_tool, run, run_all

# The C entry points each FP8 binding must call: those the CUDA FP8 backend composes (fp8/cuda.py
# for the linear, fp8/ffn.py for the FFN).
FP8_ENTRY_POINTS = {
    "fp8_op.cc": {"fastffn_fp8_quantize_cuda", "fastffn_gemm_cuda", "fastffn_last_error",
                  "fastffn_fp8_compute_scale_cuda", "fastffn_fp8_update_amax_history_cuda"},
    "swiglu_fp8_op.cc": {"fastffn_swiglu_fwd_fp8_cuda", "fastffn_swiglu_bwd_fp8_cuda"},
}
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\w+)'")


def ptxas_functions(report: str):
    """(function, arch, spill bytes) for each kernel in a ptxas -v report."""
    current = None
    for line in report.splitlines():
        entry = ENTRY.search(line)
        if entry:
            current = entry.groups()
            continue
        spill = SPILL.search(line)
        if spill and current:
            yield current[0], current[1], int(spill.group(1)) + int(spill.group(2))
            current = None


def test_cuda_kernels_compile_for_every_architecture_without_spills(cuda_objects):
    expected_archs = {f"sm_{arch}" for arch in build_definition.CUDA_ARCHS}
    for source in build_definition.cuda_kernel_sources():
        _, report = cuda_objects[source.name]
        functions = list(ptxas_functions(report))
        print(f"{source.name}: {len(functions)} kernel variants", file=sys.stderr)
        if "__global__" not in source.read_text():
            continue  # host code only (device limits, the cuBLASLt provider)
        assert functions, f"{source.name}: ptxas reported no kernels"
        assert {arch for _, arch, _ in functions} == expected_archs, source.name
        spilled = [(name, arch, b) for name, arch, b in functions if b]
        assert not spilled, f"{source.name}: register spills {spilled}"


def test_harness_flags_are_what_paddle_puts_around_ours():
    """The harness compiles .cu files with PADDLE_NVCC_PREFIX + CUDA_FLAGS; this is what the
    installed Paddle's cpp_extension does (a Paddle upgrade that changes it fails here)."""
    from paddle.utils.cpp_extension.extension_utils import prepare_unix_cudaflags

    assert prepare_unix_cudaflags(list(build_definition.CUDA_FLAGS)) == (
        build_definition.PADDLE_NVCC_PREFIX + build_definition.CUDA_FLAGS)


def paddle_include_dirs():
    from paddle.utils.cpp_extension.extension_utils import find_paddle_includes, find_python_includes

    return find_paddle_includes(use_cuda=True) + find_python_includes()


def defined_and_undefined(obj):
    """Global symbols an object defines and those it needs (nm)."""
    lines = run(["nm", "-g", obj]).stdout.splitlines()
    defined = {line.split()[-1] for line in lines if len(line.split()) == 3 and line.split()[1] != "U"}
    undefined = {line.split()[-1] for line in lines if line.split()[0] == "U"}
    return defined, undefined


def test_paddle_gpu_bindings_compile_with_cuda_and_link_to_defined_kernels(cuda_objects, tmp_path):
    require_tool("nvcc")
    require_tool("nm")
    includes = paddle_include_dirs() + [str(d) for d in build_definition.cuda_include_dirs()]
    includes.append(cuda_math_headers())
    # Paddle's cpp_extension defines PADDLE_WITH_CUDA for the .cc files of a CUDA build.
    extra = ["-DPADDLE_WITH_CUDA", *[f"-I{d}" for d in includes]]
    kernel_symbols = set()
    for obj, _ in cuda_objects.values():
        kernel_symbols |= defined_and_undefined(obj)[0]
    cpu_sources, bindings = list(build_definition.cpu_kernel_sources()), list(build_definition.binding_sources())
    assert len({s.name for s in cpu_sources + bindings}) == len(cpu_sources) + len(bindings), "one object name twice"
    run_all([build_definition.cxx_compile_command(source, tmp_path / f"{source.name}.o") for source in cpu_sources]
            + [build_definition.cxx_compile_command(source, tmp_path / f"{source.name}.o", extra) for source in bindings])
    for source in cpu_sources:
        kernel_symbols |= defined_and_undefined(tmp_path / f"{source.name}.o")[0]
    needed = {}
    for source in bindings:
        obj = tmp_path / f"{source.name}.o"
        needed[source.name] = {s for s in defined_and_undefined(obj)[1] if s.startswith("fastffn_")}
    print(f"bindings reference {sorted(set().union(*needed.values()))}", file=sys.stderr)
    for name, entry_points in FP8_ENTRY_POINTS.items():
        assert entry_points <= needed[name], f"{name} misses {sorted(entry_points - needed[name])}"
    for name, symbols in needed.items():
        assert any(s.endswith("_cuda") for s in symbols), f"{name} calls no CUDA kernel: PADDLE_WITH_CUDA unseen?"
        missing = symbols - kernel_symbols
        assert not missing, f"{name} references kernel symbols nobody defines: {sorted(missing)}"
