"""Build checks: the CUDA kernels and the Paddle GPU bindings compile (on a machine without a
GPU), and a wheel installs and works outside the checkout. A missing tool is a failure in CI
(CI=true) and a skip elsewhere, so a newcomer without nvcc can still run the suite."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from build_tools import require_cublaslt_header, require_tool, run_all  # noqa: E402

from paddle_fastffn.ops import build_definition  # noqa: E402


@pytest.fixture(scope="session")
def cuda_objects(tmp_path_factory):
    """Every CUDA kernel and host kernel file compiled as the harness and the loader compile them,
    with ptxas's resource report: {source name: (object path, ptxas report)}."""
    require_tool("nvcc")
    require_cublaslt_header()
    out = tmp_path_factory.mktemp("cuda_objects")
    sources = list(build_definition.harness_sources())
    objs = [out / f"{source.name}.o" for source in sources]
    assert len(set(objs)) == len(objs), "two sources would compile into one object at once"
    commands = [build_definition.nvcc_compile_command(source, obj, ["-Xptxas=-v"]) if source.suffix == ".cu"
                else build_definition.cxx_compile_command(source, obj) for source, obj in zip(sources, objs)]
    return {source.name: (obj, result.stderr) for source, obj, result in zip(sources, objs, run_all(commands))}
