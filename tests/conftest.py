import importlib.util
import os
import random
import sys

import pytest

# tests/ holds shared helpers (helpers.py, tolerances.py); the repository root holds benchmarks/.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

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
