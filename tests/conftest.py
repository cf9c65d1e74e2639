import importlib.util
import logging
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
# The GPU machine has torch but no Paddle: only tests/gpu is collected there. tests/torch_cpu (the GPU
# benchmarks' CPU smoke) runs in the torch environment scripts/test.sh sets up, without Paddle.
collect_ignore = ["torch_cpu"] if HAS_PADDLE else ["ops", "integration", "build_checks", "fp8", "optim"]
# tests/paddleformers runs in PaddleFormers' environment (scripts/setup_paddleformers_env.sh), which
# cannot hold PaddleNLP: scripts/test.sh runs it there.
if importlib.util.find_spec("paddlenlp") is not None or importlib.util.find_spec("paddleformers") is None:
    collect_ignore.append("paddleformers")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    """The run's first lines say whether PaddleNLP's own fine-tune script is here (its tests skip
    without it) and how to point the tests at it: not only pytest's skip summary at the end. Written
    by the terminal reporter, so `-q` (scripts/test.sh) shows it too, where a report header would not."""
    from shared_assets import header_line

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(header_line())


def pytest_collection_finish(session):
    """A whole-suite run must collect every test file on disk: pytest silently skips folders named
    like build outputs (its default norecursedirs has `build`, which once hid tests/build, as a
    .gitignore rule hid it before that)."""
    if [os.path.abspath(str(a)) for a in session.config.args] not in ([TESTS_DIR], [os.path.dirname(TESTS_DIR)]):
        return
    on_disk = {os.path.join(root, name) for root, _, names in os.walk(TESTS_DIR) for name in names
               if name.startswith("test_") and name.endswith(".py")
               and os.path.relpath(root, TESTS_DIR).split(os.sep)[0] not in collect_ignore + ["gpu"]}
    collected = {str(item.path) for item in session.items}
    missing = sorted(os.path.relpath(p, TESTS_DIR) for p in on_disk - collected)
    if missing and not session.config.option.keyword:
        raise pytest.UsageError(f"test files on disk that pytest did not collect: {missing}")


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


@pytest.fixture
def info_lines():
    """The paddle_fastffn info lines PaddleNLP's logger prints (it does not propagate to caplog)."""
    from paddlenlp.utils.log import logger

    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("paddle_fastffn:"):
                lines.append(record.getMessage())

    handler = Collect()
    logger.logger.addHandler(handler)
    yield lines
    logger.logger.removeHandler(handler)
