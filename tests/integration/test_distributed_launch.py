"""The tests' two-rank launcher retries Paddle's TCP-store teardown abort and nothing else
(tests/integration/distributed_launch.py says why). Real launches of a tiny script: rank 0 aborts at
exit the way that bug does (SIGABRT with Paddle's handler gone, after the script's work), once; or
with a live error first."""

import textwrap

import pytest

from tests.integration.distributed_launch import is_store_teardown_abort, run_launch

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import paddle.distributed as dist

    dist.init_parallel_env()
    marker = sys.argv[1] + f".rank{dist.get_rank()}"
    first_attempt = not os.path.exists(marker)
    open(marker, "w").close()
    print("work done", flush=True)
    if dist.get_rank() == 0 and (first_attempt or sys.argv[2] == "always"):
        if sys.argv[3] == "live_error":
            print("Traceback (most recent call last):", flush=True)
        signal.signal(signal.SIGABRT, signal.SIG_DFL)  # as at exit: Paddle's handler no longer prints
        os.abort()
""")


def launch(tmp_path, when: str, how: str):
    script = tmp_path / "abort_at_exit.py"
    script.write_text(SCRIPT)
    return run_launch([script, tmp_path / "attempted", when, how], tmp_path / "logs", cwd=tmp_path, timeout=300)


def test_a_store_teardown_abort_is_rerun(tmp_path, capfd):
    result, logs = launch(tmp_path, "once", "teardown")
    assert result.returncode == 0, result.stdout[-3000:]
    assert sorted(logs) == [0, 1] and all("work done" in text for text in logs.values())
    assert "rank 0 aborted in Paddle's TCP store teardown (attempt 1)" in capfd.readouterr().err


@pytest.mark.parametrize("when, how", [("always", "teardown"), ("once", "live_error")])
def test_other_failures_are_not_hidden(tmp_path, capfd, when, how):
    # The teardown signature on every attempt still fails; a rank-0 abort after a live error is not retried.
    result, logs = launch(tmp_path, when, how)
    assert result.returncode != 0
    retries = capfd.readouterr().err.count("rerunning")
    assert retries == (2 if when == "always" else 0)


def test_the_signature_is_rank_0_sigabrt_without_a_live_error():
    failed = "LAUNCH ERROR Container failed !!!\nContainer rank {} status failed cmd ['python'] code {} log x\n"
    assert is_store_teardown_abort(failed.format(0, -6), {0: "eval metrics", 1: ""})
    assert not is_store_teardown_abort(failed.format(1, -6), {0: "", 1: ""})
    assert not is_store_teardown_abort(failed.format(0, 1), {0: "", 1: ""})
    assert not is_store_teardown_abort(failed.format(0, -6), {0: "Error Message Summary:\nFatalError", 1: ""})
    assert not is_store_teardown_abort(failed.format(0, -6), {0: "", 1: "Traceback (most recent call last):"})
