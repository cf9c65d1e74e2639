import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="GPU kernel tests run through the torch harness")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the GPU kernel tests run on the H200 machine", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))  # gpu_checks.py


@pytest.fixture(autouse=True)
def _poison_and_seed():
    """Every output buffer of the harness starts as NaN (FP8: the NaN byte), so an element a kernel
    fails to write fails the comparison; and a fixed seed."""
    from benchmarks.gpu import harness

    harness.POISON_OUTPUTS = True
    torch.manual_seed(0)
    yield
    harness.POISON_OUTPUTS = False
