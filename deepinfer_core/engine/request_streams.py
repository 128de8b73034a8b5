"""Several consumers (threads, generators) sharing one engine.

Any consumer that needs output drives the engine: under one lock it runs a step and files every
output in the mailbox of the request it belongs to, then takes what is in its own mailboxes.
So a ``stream()`` interleaved with a ``generate()`` on another thread, or with a second
``stream()`` left half-read, never loses another consumer's deltas, and all of them share the
same batches. No background thread: an engine nobody waits on does no work.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Iterable

from .outputs import RequestOutput


class RequestStreams:
    def __init__(self, engine) -> None:
        self._engine = engine
        self._lock = threading.RLock()  # re-entrant: a generator's cleanup may run mid-step
        self._boxes: dict[str, deque[RequestOutput]] = {}

    def submit(self, add: Callable[[], list[str]]) -> list[str]:
        """Run ``add`` (which adds requests to the engine and returns their ids) and open a
        mailbox for each, atomically: no step can run between the two."""
        with self._lock:
            ids = add()
            for request_id in ids:
                self._boxes[request_id] = deque()
            return ids

    def next_outputs(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Outputs of any of ``request_ids`` that are waiting, stepping the engine until there
        are some. A request whose last output was taken is forgotten."""
        wanted = list(request_ids)
        wanted_set = set(wanted)
        with self._lock:
            filled = True  # a box of ``wanted`` may hold outputs (only a step of this loop fills one later)
            while True:
                if filled:
                    ready = [out for request_id in wanted for out in self._take(request_id)]
                    if ready:
                        return ready
                # the checks by set (a 256-request decode step whose callers want only final
                # outputs runs this loop once a step, with nothing ready)
                if not wanted_set <= self._boxes.keys():
                    missing = [i for i in wanted if i not in self._boxes]
                    raise KeyError(
                        f"requests {missing} are not waiting for output (finished, aborted or never submitted)"
                    )
                if (
                    not wanted_set <= self._engine.scheduler.requests.keys()
                ):  # aborted behind our back (engine.abort_request): never wait forever
                    gone = [i for i in wanted if i not in self._engine.scheduler.requests]
                    raise RuntimeError(f"requests {gone} left the engine without a final output")
                filled = False
                for out in self._engine.step():
                    box = self._boxes.get(out.request_id)
                    if box is not None:
                        box.append(out)
                        filled = filled or out.request_id in wanted_set

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop requests nobody will read any more, and drop their mailboxes."""
        with self._lock:
            for request_id in request_ids:
                if self._boxes.pop(request_id, None) is not None:
                    self._engine.abort_request(request_id)

    def _take(self, request_id: str) -> list[RequestOutput]:
        box = self._boxes.get(request_id)
        if not box:
            return []
        outs = list(box)
        box.clear()
        if outs[-1].finished:
            del self._boxes[request_id]
        return outs
