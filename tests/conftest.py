import importlib.util
import os
import random
import sys

import pytest

# tests/ holds shared helpers (helpers.py, tolerances.py); the repository root holds benchmarks/.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

# Every fallback from a compiled kernel to the *_ref path (or from the fused LLaMA path to stock
# math) is an error in the tests, subprocesses included; tests that exercise a fallback ask for it
# with the `allow_fallback` fixture.
os.environ["PADDLE_FASTFFN_STRICT"] = "1"

HAS_PADDLE = importlib.util.find_spec("paddle") is not None
# The GPU machine has torch but no Paddle: only tests/gpu is collected there.
collect_ignore = [] if HAS_PADDLE else ["ops", "integration", "build"]


@pytest.fixture(autouse=True)
def _seed():
    random.seed(1234)
    if HAS_PADDLE:
        import numpy as np
        import paddle

        paddle.seed(1234)
        np.random.seed(1234)
    yield


@pytest.fixture
def allow_fallback(monkeypatch):
    """This test exercises a fallback on purpose: it warns instead of raising."""
    monkeypatch.setenv("PADDLE_FASTFFN_STRICT", "0")


@pytest.fixture
def kernel_calls():
    """kernel_calls() -> how often each compiled op ran since the test began (a Counter)."""
    from collections import Counter

    from paddle_fastffn.ops import _loader

    before = Counter(_loader.CALL_COUNTS)
    return lambda: Counter(_loader.CALL_COUNTS) - before
