"""The Paddle fast path executes exactly the committed traces (tests/traces/*.json): every kernel
and framework op, forward and backward, copies, casts, fills and host reads included, for one
decoder layer and one whole training step. The GPU harness is held to the same files
(tests/gpu/test_trace.py), so neither side can do work the other skips without a test failing.
After an intended change, regenerate with `python -m tests.integration.trace_paddle --write` and
review the diff of tests/traces/."""

import json

import pytest

from paddle_fastffn.core import trace
from tests.integration import trace_paddle


@pytest.fixture(scope="module")
def recorded():
    return trace_paddle.traces()


@pytest.mark.parametrize("name", ["decoder_layer", "training_step", "packed_training_step"])
def test_paddle_path_executes_the_committed_trace(recorded, name):
    committed = json.loads((trace_paddle.TRACES / f"{name}.json").read_text())
    assert committed["shape"] == trace_paddle.SHAPE, "the committed trace is of another shape: regenerate it"
    message = trace.difference(trace.entries_of(committed), trace.entries_of(recorded[name]))
    assert message is None, f"{name}: the Paddle path no longer executes tests/traces/{name}.json\n{message}"


def test_every_recorded_op_is_in_the_equivalence_table(recorded):
    """An op the table does not know is recorded as `unmapped`: it must be named (with why) in
    paddle_fastffn/core/trace.py's EQUIVALENCE before it can be compared."""
    unmapped = [trace.format_entry(e) for doc in recorded.values() for e in trace.entries_of(doc)
                if e.category == "unmapped"]
    assert not unmapped, "\n".join(unmapped)


def test_the_recorder_sees_backward_copies_and_host_reads(recorded):
    """The recorder's reach, on ops the fast path runs today: a backward GEMM of every linear, our
    kernels in backward, and the fused loss's one read to the host."""
    step = trace.entries_of(recorded["training_step"])
    roles = {(e.role, e.category, e.name) for e in step}
    assert {("backward", "kernel", "rms_norm_bwd"), ("backward", "kernel", "swiglu_bwd"),
            ("backward", "kernel", "rotary"), ("backward", "gemm", "gemm"), ("backward", "attention", "attention"),
            ("backward", "host_read", "host_read"), ("optimizer", "kernel", "adamw")} <= roles
    # one update per parameter: embedding, final norm, LM head, and per layer qkv, o, gate_up, down, two norms
    parameters = 3 + 6 * trace_paddle.MODEL["num_hidden_layers"]
    assert sum(e.name == "adamw" for e in step) == parameters


def test_difference_names_the_first_differing_entry():
    a = [trace.Entry("gemm", "gemm", (1, 2), (3,), "forward"), trace.Entry("copy", "split", (4,), (2, 2), "forward")]
    b = [a[0], trace.Entry("kernel", "rotary", (4,), (4,), "forward")]
    message = trace.difference(a, b)
    assert "differ at entry 1" in message and "split" in message and "rotary" in message
    assert trace.difference(a, [e._replace(bytes=7) for e in a]) is None  # bytes are reported, not compared
