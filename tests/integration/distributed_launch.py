"""Two-rank runs under paddle.distributed.launch for the tests, and the one failure of Paddle's own
that they retry.

Paddle 3.3.1's TCP store (the libuv server, FLAGS_tcp_store_using_libuv, on by default) serves from a
thread of rank 0 that is never stopped before the process ends. When another rank closes its store
connection while rank 0 is already in its C++ exit handlers, that thread's read callback aborts
rank 0 (SIGABRT): the launcher reports "Container rank 0 status failed ... code -6" after the script
has finished, with no Python traceback and no Paddle error summary in rank 0's log (its signal
handler is gone by then). Core dumps of it show the aborting thread in
LibUVMasterDaemon::run -> LibUVClient::readCallback -> abort while the main thread is in
__run_exit_handlers. It hit 5 of 118 two-rank launches of PaddleNLP's llm script on a loaded 2-core
machine (2 of them stock runs, 3 the plugin's; benchmarks/results/launch_teardown_abort.json) and
failed CI once (stop 26). Only that
signature is retried; any other failure, or the same one on every attempt, fails the test.

When rank 0 fails, the launcher stops the other ranks with SIGTERM; a rank still in its own exit then
prints Paddle's signal report ("C++ Traceback", "Error Message Summary", FatalError `Termination
signal` ... from PID <the launcher>). That report is the launcher's doing, not an error of that rank,
so it is left out of the search for a live error; anything before it still counts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

STORE_TEARDOWN_ABORT = re.compile(r"Container rank 0 status failed .* code -6 ")
LIVE_ERROR_MARKS = ("Traceback (most recent call last)", "Error Message Summary")
# Paddle's report of a SIGTERM, ending the log; group 1 is the sender's pid.
SIGTERM_REPORT = re.compile(
    r"(?:-+\nC\+\+ Traceback \(most recent call last\):\n-+\n(?:\d+ +[^\n]*\n|No stack trace in paddle[^\n]*\n)*\s*)?"
    r"-+\nError Message Summary:\n-+\nFatalError: `Termination signal` is detected by the operating system\.\n"
    r"(?: +\[TimeInfo: [^\n]*\n)? +\[SignalInfo: \*\*\* SIGTERM \(@0x[0-9a-f]+\) received by PID \d+ "
    r"\(TID 0x[0-9a-f]+\) from PID (\d+) \*\*\*\]\s*\Z")
ATTEMPTS = 3


def worker_logs(log_dir: Path) -> dict:
    """{rank: text} of the launcher's workerlog.<rank> files."""
    return {int(p.name.rsplit(".", 1)[1]): p.read_text(errors="replace")
            for p in sorted(Path(log_dir).glob("workerlog.*")) if p.name.rsplit(".", 1)[1].isdigit()}


def without_launcher_stop(log: str, launcher_pid: int) -> str:
    """A rank's log less Paddle's report of a SIGTERM from the launcher at its end."""
    report = SIGTERM_REPORT.search(log)
    return log[:report.start()] if report and int(report.group(1)) == launcher_pid else log


def is_store_teardown_abort(launcher_output: str, logs: dict, launcher_pid: int) -> bool:
    """Rank 0 killed by SIGABRT with no error of a live process in any rank's log: Paddle's TCP store
    at exit (an error on another rank is a failure of its own, never rerun; the launcher's own SIGTERM
    of a rank after rank 0 failed is not one)."""
    return (STORE_TEARDOWN_ABORT.search(launcher_output) is not None
            and not any(mark in without_launcher_stop(text, launcher_pid)
                        for text in logs.values() for mark in LIVE_ERROR_MARKS))


def run_once(cmd: list, timeout: int, **kwargs):
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout), and the launcher's pid."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), proc.pid


def run_launch(args: list, log_dir, reset=(), via=(), timeout: int = 600, **kwargs):
    """`python *via -m paddle.distributed.launch --nproc_per_node 2 --log_dir log_dir *args` (via: the
    plugin's `-m paddle_fastffn` in front), rerun (after removing log_dir and the `reset` paths, e.g.
    the output folder a rerun would resume from) only when it ended in Paddle's store-teardown abort.
    Returns (CompletedProcess, {rank: worker log})."""
    cmd = [sys.executable, *via, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
           "--log_dir", str(log_dir), *map(str, args)]
    for attempt in range(1, ATTEMPTS + 1):
        result, launcher_pid = run_once(cmd, timeout, **kwargs)
        logs = worker_logs(Path(log_dir))
        if result.returncode == 0 or not is_store_teardown_abort(result.stdout + result.stderr, logs, launcher_pid):
            return result, logs
        if attempt < ATTEMPTS:
            print(f"distributed_launch: rank 0 aborted in Paddle's TCP store teardown (attempt {attempt}); "
                  f"rerunning", file=sys.stderr)
            for path in (log_dir, *reset):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
    return result, logs
