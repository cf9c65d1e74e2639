"""The tests' two-rank launcher retries Paddle's TCP-store teardown abort and nothing else
(tests/integration/distributed_launch.py says why). Real launches of a tiny script: rank 0 aborts at
exit the way that bug does (SIGABRT with Paddle's handler gone, after both ranks' work), once; or
with a live error first."""

import textwrap

import pytest

from tests.integration.distributed_launch import is_store_teardown_abort, run_launch

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import paddle.distributed as dist
    from paddle.base import core

    dist.init_parallel_env()
    marker = sys.argv[1] + f".rank{dist.get_rank()}"
    first_attempt = not os.path.exists(marker)
    open(marker, "w").close()
    print("work done", flush=True)
    store = core.create_or_get_global_tcp_store()
    if dist.get_rank() == 1:
        store.set("rank1_done", b"1")
    elif first_attempt or sys.argv[2] == "always":
        # As in Paddle's bug, only once the other rank is through its work: an abort while rank 1 is still in
        # init_parallel_env fails rank 1 on its own (a gloo TIMEOUT, a live error that is never rerun).
        store.wait("rank1_done")
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
    launcher = 4242
    assert is_store_teardown_abort(failed.format(0, -6), {0: "eval metrics", 1: ""}, launcher)
    assert not is_store_teardown_abort(failed.format(1, -6), {0: "", 1: ""}, launcher)
    assert not is_store_teardown_abort(failed.format(0, 1), {0: "", 1: ""}, launcher)
    assert not is_store_teardown_abort(failed.format(0, -6), {0: "Error Message Summary:\nFatalError", 1: ""}, launcher)
    assert not is_store_teardown_abort(failed.format(0, -6), {0: "", 1: "Traceback (most recent call last):"}, launcher)


def test_the_launcher_stopping_the_other_rank_is_not_a_live_error():
    # The launcher SIGTERMs rank 1 once rank 0 has failed; rank 1, still in its exit, prints Paddle's signal
    # report (as captured under load). Only that report, at the end of the log and from the launcher, is left out.
    failed = "LAUNCH ERROR Container failed !!!\nContainer rank 0 status failed cmd ['python'] code -6 log x\n"
    stopped = ("work done\n\n\n--------------------------------------\n"
               "C++ Traceback (most recent call last):\n--------------------------------------\n"
               "0   gloo::Context::~Context()\n1   gloo::transport::tcp::Loop::~Loop()\n\n"
               "----------------------\nError Message Summary:\n----------------------\n"
               "FatalError: `Termination signal` is detected by the operating system.\n"
               "  [TimeInfo: *** Aborted at 1796569588 (unix time) try \"date -d @1796569588\" if you are using "
               "GNU date ***]\n"
               "  [SignalInfo: *** SIGTERM (@0x56ca) received by PID 22229 (TID 0x7f8b3b485b80) from PID {} ***]\n")
    assert is_store_teardown_abort(failed, {0: "work done", 1: stopped.format(22218)}, 22218)
    assert not is_store_teardown_abort(failed, {0: "work done", 1: stopped.format(777)}, 22218)
    live_error = "Traceback (most recent call last):\nRuntimeError: gloo TIMEOUT\n"
    assert not is_store_teardown_abort(failed, {0: "work done", 1: live_error + stopped.format(22218)}, 22218)
