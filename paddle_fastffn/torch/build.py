"""The kernel library's one build definition (paddle_fastffn/ops/build_definition.py), loaded by
path and without torch: importing it as paddle_fastffn.ops.build_definition would import Paddle
(ops/__init__.py), which the GPU machine does not have. The Paddle loader, this binding's builds
(c_api.build(), cpu_kernels.build()) and the optimizer benchmark's baseline library
(benchmarks/gpu/paddle_adamw_library.py) compile from this one definition."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "paddle_fastffn_build_definition", REPO / "paddle_fastffn" / "ops" / "build_definition.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


definition = _load()
