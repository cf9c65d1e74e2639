import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration"))


@pytest.fixture(autouse=True)
def _stock_after_each_test():
    """Patches are class-level: every test starts and ends on stock PaddleFormers."""
    import paddle_fastffn

    paddle_fastffn.revert_fast_ffn()
    yield
    paddle_fastffn.revert_fast_ffn()
