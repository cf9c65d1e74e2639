"""paddle_fastffn/ops/build_definition.py, imported by path and without torch: the GPU machine has
no Paddle, and the package's __init__ imports it. The Paddle loader, the harness (harness.py) and
the baseline library (paddle_adamw_library.py) build from this one definition."""

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
