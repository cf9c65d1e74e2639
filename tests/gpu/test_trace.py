"""The GPU harness executes exactly what the Paddle path executes: its FastDecoderLayer and its
FastLlama + FusedMasterAdamW step, recorded on the H200 by tests/gpu/trace_torch.py (ATen ops
forward and backward, our C kernels, host reads), equal the committed traces tests/traces/*.json
that tests/integration/test_trace.py holds the Paddle path to (paddle_fastffn/core/trace.py says
how the two frameworks' ops are made comparable). A difference means the benchmark times other
work than Paddle users run: fix the side that is wrong, never the committed file alone."""

import pytest

from paddle_fastffn.core import trace


@pytest.fixture(scope="module")
def recorded():
    from paddle_fastffn.torch import c_api
    from tests.gpu import trace_torch

    # NaN-poisoned outputs are a test device (tests/gpu/conftest.py), not the product's work: a
    # poisoning fill would show as an op Paddle does not run.
    poison, c_api.POISON_OUTPUTS = c_api.POISON_OUTPUTS, False
    try:
        shape = trace_torch.committed("decoder_layer")["shape"]
        return trace_torch.traces(shape)
    finally:
        c_api.POISON_OUTPUTS = poison


@pytest.mark.parametrize("name", ["decoder_layer", "training_step", "packed_training_step"])
def test_harness_executes_the_committed_trace(recorded, name):
    from tests.gpu import trace_torch

    entries, _ = recorded[name]
    message = trace.difference(trace.entries_of(trace_torch.committed(name)), entries)
    unmapped = sorted({e.name for e in entries if e.category == "unmapped"})
    assert message is None, (f"{name}: the harness does not execute tests/traces/{name}.json\n{message}\n"
                             f"torch ops missing from paddle_fastffn/core/trace.py's EQUIVALENCE: {unmapped}")
