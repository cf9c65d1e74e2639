"""Where the tests find ../shared (PaddleNLP's own llm/ script, the SFT length data): beside the
checkout in CI, elsewhere wherever PADDLE_FASTFFN_SHARED points. Imports nothing heavy: the root
conftest reads it for the test run's header."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_ENV = "PADDLE_FASTFFN_SHARED"
SHARED = Path(os.environ.get(SHARED_ENV, REPO.parent / "shared"))
CLIENT = SHARED / "clients" / "paddlenlp_llm_v2.8" / "llm"
CLIENT_TESTS = "tests/integration/test_paddlenlp_client.py"


def client_present() -> bool:
    return (CLIENT / "finetune_generation.py").is_file()


def header_line() -> str:
    """One line for the top of a test run: whether PaddleNLP's own script is here, and if not, how
    to run its tests."""
    if client_present():
        return f"PaddleNLP client script: {CLIENT} ({CLIENT_TESTS} runs it)"
    return (f"PaddleNLP client script NOT FOUND at {CLIENT}: {CLIENT_TESTS} will be SKIPPED. To run them, put "
            f"shared/ beside the checkout or set {SHARED_ENV}=/path/to/shared")
