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

