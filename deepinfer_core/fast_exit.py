"""Ending the ``deepinfer`` process as soon as its command is done.

After a command returns, a normal interpreter exit tears down every module: with torch and
~1,400 modules loaded, CPython's finalisation garbage-collects the whole heap several times
and torch unregisters its operators one by one. That is ~0.5 s of CPU on an idle 2-core EPYC
(perf: 75% in ``gc_collect_main``, 13% in torch's dispatcher, the rest ``free``), 3-4 s of
wall time on a busy one, all of it after the user's last token. Nothing in it is the user's:
the operating system reclaims memory and mappings of a process that ends.

:func:`exit_process` keeps what a normal exit guarantees and skips only that teardown: it
waits for non-daemon threads through ``threading._shutdown`` (as a normal exit does, so a
background write still in flight finishes and executors' idle workers are told to stop), runs
the ``atexit`` handlers (logging's flush, multiprocessing's child reaping, caches), flushes
``sys.stdout``/``sys.stderr``, then calls ``os._exit``. Used only by the console entry
points; ``cli.main`` itself returns normally so that tests and embedding applications calling
it keep their interpreter.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_process(status: int) -> None:
    """Exit with ``status`` without the interpreter's module teardown (see the module doc)."""
    # CPython's own first step at exit: the callbacks of ``threading._register_atexit`` (a
    # ``ThreadPoolExecutor`` tells its idle workers to stop there), then a join of every
    # non-daemon thread. Joining without those callbacks waits forever on an executor's
    # idle workers (the KV tiers' loader and writer: ``serve --kv-store`` never exited).
    threading._shutdown()
    atexit._run_exitfuncs()  # CPython's own call at exit; os._exit below would skip them
    code = status
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (``| head``) or a closed stream
            if stream is sys.stdout:
                code = 120  # what CPython exits with when flushing stdout fails at exit
    os._exit(code)
