"""The harness's trace on the CPU (the C API's CPU kernels, paddle_fastffn.torch.cpu_kernels.select()) against the committed
traces the Paddle path executes (tests/traces/*.json): the same check as tests/gpu/test_trace.py, run in
CI so that a change to the harness's composition fails before the next GPU run. Two things the CPU cannot
show are left out, each named: reads to the host (the torch recorder sees a read as a copy that leaves the
device; on the CPU nothing leaves it), and, for packed batches, the backward pass (on the GPU the varlen
attention's backward is one flash-attention kernel, here the per-segment reference's own ops, interleaved
with the layer's; the plain training step checks the rest of the backward). Everything else, forward,
backward and optimizer, must match entry for entry."""

from __future__ import annotations

import pytest

from paddle_fastffn.core import trace


@pytest.fixture(scope="module")
def recorded():
    from paddle_fastffn.torch import c_api, cpu_kernels
    from tests.gpu import trace_torch

    cpu_kernels.select()
    poison, c_api.POISON_OUTPUTS = c_api.POISON_OUTPUTS, False
    try:
        return trace_torch.traces(trace_torch.committed("decoder_layer")["shape"], "cpu")
    finally:
        c_api.POISON_OUTPUTS = poison


def seen_on_cpu(entries, packed: bool) -> list:
    kept = [e for e in entries if e.category != "host_read"]
    if packed:  # the reference's backward ops are interleaved with the layer's: forward and optimizer only
        kept = [e for e in kept if e.role != "backward"]
    return kept


@pytest.mark.parametrize("name", ["decoder_layer", "training_step", "packed_training_step"])
def test_harness_on_cpu_executes_the_committed_trace(recorded, name):
    from tests.gpu import trace_torch

    entries, _ = recorded[name]
    expected = trace.entries_of(trace_torch.committed(name))
    if name == "decoder_layer":  # no host read, no packed attention: entry for entry
        message = trace.difference(expected, entries)
    else:
        message = trace.difference(seen_on_cpu(expected, "packed" in name), seen_on_cpu(entries, "packed" in name))
    assert message is None, f"{name}: the harness on CPU does not execute tests/traces/{name}.json\n{message}"
