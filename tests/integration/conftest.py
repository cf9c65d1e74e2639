import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _stock_after_each_test():
    """Patches are class-level: every test starts and ends on stock PaddleNLP."""
    import paddle_fastffn

    paddle_fastffn.revert_fast_ffn()
    yield
    paddle_fastffn.revert_fast_ffn()


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
