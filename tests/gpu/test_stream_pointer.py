"""c_api.current_stream, the stream every C kernel call of the harness is issued on (both c_api.py
files): it is torch.cuda.current_stream().cuda_stream, on the default stream, inside a
torch.cuda.stream block on a side stream, after it, under torch.cuda.device, and during a CUDA
graph capture (the capture stream), and a kernel called inside a side-stream block runs there."""

from __future__ import annotations

import torch

from paddle_fastffn.torch import c_api
from paddle_fastffn.torch.fp8 import c_api as fp8_c_api


def _raw() -> int:
    return c_api.current_stream().value or 0  # c_void_p(0).value is None: the legacy default stream


def _same_as_torch() -> int:
    expected = torch.cuda.current_stream().cuda_stream
    assert _raw() == expected
    assert (c_api.Kernels._stream().value or 0) == expected
    assert (fp8_c_api.Fp8Kernels._stream().value or 0) == expected
    return expected


def test_current_stream_is_torchs_current_stream():
    default = _same_as_torch()
    assert default == torch.cuda.default_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert _same_as_torch() == side.cuda_stream != default
        nested = torch.cuda.Stream()
        with torch.cuda.stream(nested):
            assert _same_as_torch() == nested.cuda_stream
        assert _same_as_torch() == side.cuda_stream
    assert _same_as_torch() == default


def test_current_stream_follows_the_current_device():
    for device in range(torch.cuda.device_count()):
        with torch.cuda.device(device):
            _same_as_torch()
            side = torch.cuda.Stream(device)
            with torch.cuda.stream(side):
                assert _same_as_torch() == side.cuda_stream


def test_current_stream_in_a_graph_capture_is_the_capture_stream():
    x = torch.ones(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        seen = _same_as_torch()
        x.mul_(2)
    torch.cuda.current_stream().wait_stream(side)
    assert seen == side.cuda_stream


def test_a_kernel_in_a_side_stream_block_runs_on_that_stream():
    """The SwiGLU kernel issued inside torch.cuda.stream(side) while the default stream is held by
    a long sleep: it finishes on side before the default stream's work does."""
    k = c_api.kernels()
    gate_up = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    k.swiglu_fwd(gate_up)  # loads the kernel
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on the default stream
    with torch.cuda.stream(side):
        out = k.swiglu_fwd(gate_up)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    assert not torch.cuda.default_stream().query(), "the kernel waited for the default stream"
    reference = torch.nn.functional.silu(gate_up[:, :128].float()) * gate_up[:, 128:].float()
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)
    torch.cuda.synchronize()
