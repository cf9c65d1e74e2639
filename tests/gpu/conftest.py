import pytest

torch = pytest.importorskip("torch", reason="GPU kernel tests run through the torch harness")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: the GPU kernel tests run on the H200 machine", allow_module_level=True)
