import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="GPU kernel tests run through the torch harness")

sys.path.insert(0, os.path.dirname(__file__))  # gpu_checks.py
HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    """Without a CUDA GPU the tests are collected (so every module here is imported: the binding's
    imports are checked on any torch machine) and skipped: they run on the GPU machine."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU: the GPU kernel tests run on the H200 machine")
    for item in items:
        if os.path.abspath(str(item.path)).startswith(HERE + os.sep):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _poison_and_seed():
    """Every output buffer of the harness starts as NaN (FP8: the NaN byte), so an element a kernel
    fails to write fails the comparison; and a fixed seed."""
    from paddle_fastffn.torch import c_api

    c_api.POISON_OUTPUTS = True
    torch.manual_seed(0)
    yield
    c_api.POISON_OUTPUTS = False
