"""``deepinfer``'s console entry ends the process without the interpreter's module teardown
(``deepinfer_core.fast_exit``); these check that it keeps what a normal exit guarantees: the
exit status, buffered output, ``atexit`` handlers, non-daemon threads run to their end. Each
case runs in a child process without torch (cheap)."""

from __future__ import annotations

import os
import subprocess
import sys

BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout on a pipe is block-buffered

CHILD = r"""
import atexit, sys, threading, time
from deepinfer_core.fast_exit import exit_process

def late_write():
    time.sleep(0.3)
    with open(sys.argv[1], "w") as f:
        f.write("written")

atexit.register(lambda: print("atexit ran", file=sys.stderr))
threading.Thread(target=late_write).start()
print("buffered output", end="")  # a pipe: block-buffered, still in the buffer here
exit_process(3)
print("never")
"""


def test_exit_keeps_status_output_atexit_and_threads(tmp_path):
    marker = tmp_path / "marker"
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(marker)], env=BUFFERED, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3
    assert result.stdout == "buffered output"
    assert result.stderr.strip() == "atexit ran"
    assert marker.read_text() == "written"  # the non-daemon thread was waited for


def test_console_entry_keeps_argparse_errors_and_help():
    bad = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.entrypoints", "no-such-command"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "invalid choice: 'no-such-command'" in bad.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.entrypoints", "--help"], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0
    assert ok.stdout.startswith("usage: deepinfer")


def test_a_closed_stdout_exits_as_python_does():
    """``deepinfer ... | head -1``: stdout's reader is gone when the buffer is flushed at exit.
    The fast exit ends with the status CPython's own exit gives then (the reference: the same
    child ending with ``sys.exit``), without hanging."""
    body = (
        "import sys, time\nfrom deepinfer_core.fast_exit import exit_process\ntime.sleep(0.5)\nsys.stdout.write('x')\n"
    )
    statuses = []
    for ending in ("sys.exit(0)", "exit_process(0)"):
        child = subprocess.Popen(
            [sys.executable, "-c", body + ending], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=BUFFERED
        )
        child.stdout.close()  # the reader goes away before the child writes
        _, err = child.communicate(timeout=60)
        statuses.append(child.returncode)
    assert statuses[0] == 120  # CPython: flushing stdout failed at exit
    assert statuses[1] == statuses[0]


def test_idle_executor_workers_do_not_hold_the_exit():
    """A ``ThreadPoolExecutor`` with an idle worker (the KV tiers keep three): a normal exit
    tells such workers to stop before joining them; the fast exit must too, or it waits forever
    (``deepinfer serve --kv-store`` did not end on SIGTERM). The reference is the same child
    ending with ``sys.exit``; the submitted job must have run in both."""
    body = (
        "import sys\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "from deepinfer_core.fast_exit import exit_process\n"
        "pool = ThreadPoolExecutor(1)\npool.submit(print, 'job ran').result()\n"
    )
    for ending in ("sys.exit(0)", "exit_process(0)"):
        result = subprocess.run([sys.executable, "-c", body + ending], capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stdout) == (0, "job ran\n"), ending
