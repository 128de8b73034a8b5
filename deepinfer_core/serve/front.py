"""The async front of one engine: the step loop in its own thread, one sink per request.

::

    event loop (HTTP)                       step thread (owns the LLMEngine)
    -----------------                       --------------------------------
    submit(Submission, sink) --commands-->  add_request / abort_request
                                            step() -> outputs
    await sink.admitted      <--call_soon_threadsafe-- admitted / refused (ValueError)
    await sink.final         <--call_soon_threadsafe-- last snapshot (finished)
    frames thread reads sink.outputs <----- every snapshot (streams only; a request nobody
                                            streams is final_only: first and last snapshot)

Only the step thread ever touches the engine, so the engine needs no locks and the event loop
never waits on a step: ``/health`` and ``/metrics`` answer from the last published stats.
Admission is bounded: at most ``max_num_seqs + max_queue`` requests in flight; one more is
refused with :class:`QueueFull` (the HTTP layer turns that into a 429).

In-flight accounting is one :class:`Lease` per admitted request: :meth:`EngineFront.submit` is
the only place that counts a request in, and :meth:`Lease.release` (called by the HTTP exchange
in a ``finally``, however it ends) the only place that counts it out; releasing also aborts the
engine request, which is a no-op when it already finished. So no way out of an exchange (a stream
closed before its first event, a client gone mid-request, an exception in a codec) can leave a
slot taken or an engine request running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


class QueueFull(Exception):
    """The waiting queue is full: try again later."""


class Closed(Exception):
    """The server is draining or stopped and takes no new requests."""


@dataclass(frozen=True)
class Submission:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    final_only: bool = (
        False  # nothing reads its snapshots as they come (not streamed): the engine builds its first and last only
    )


@dataclass(frozen=True)
class StepTiming:
    """What the metrics need about one request output, measured in the step thread."""

    step_start: float
    now: float
    arrival: float
    first: bool  # the request's first output (its prefill finished in this step)
    previous: float  # time of the request's previous output (arrival if first)


class Lease:
    """An admitted request's slot in the front; :meth:`release` exactly once (idempotent)."""

    def __init__(self, front: "EngineFront", request_id: str) -> None:
        self._front = front
        self.request_id = request_id
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._front._release(self.request_id)


class RequestSink:
    """Where the step thread hands one request's results (thread safe).

    ``admitted`` resolves to None or the exception that refused the request; ``final`` to the
    last snapshot (None when aborted or failed); streams also get every snapshot on
    ``outputs`` (a blocking queue, read by the codec's frames thread), then a ``None`` at the end.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self._loop = loop
        self.admitted: asyncio.Future = loop.create_future()
        self.final: asyncio.Future = loop.create_future()
        self.outputs: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        self.error: BaseException | None = None

    def _resolve(self, future: asyncio.Future, value) -> None:
        def setter() -> None:
            if not future.done():
                future.set_result(value)

        self._loop.call_soon_threadsafe(setter)

    def admit(self, error: BaseException | None) -> None:
        self._resolve(self.admitted, error)
        if error is not None:
            self.close()

    def put(self, out: RequestOutput) -> None:
        if self.outputs is not None:
            self.outputs.put(out)
        if out.finished:
            self._resolve(self.final, out)
            if self.outputs is not None:
                self.outputs.put(None)

    def close(self, error: BaseException | None = None) -> None:
        """The request ended without a finished snapshot (aborted, or the step failed)."""
        self.error = error
        self._resolve(self.final, None)
        if self.outputs is not None:
            self.outputs.put(None)


class EngineFront:
    """Owns the engine and its step thread. ``on_output(out, timing)`` and
    ``on_step(stats)`` are called in the step thread (metrics)."""

    def __init__(
        self,
        engine,
        *,
        max_queue: int,
        on_output: Callable[[RequestOutput, StepTiming], None] | None = None,
        on_step: Callable[[dict], None] | None = None,
        on_abort: Callable[[str], None] | None = None,
        on_early_stop: Callable[[str, float], None] | None = None,
    ) -> None:
        self.engine = engine
        self.capacity = engine.config.max_num_seqs + max_queue
        self._on_output = on_output or (lambda out, timing: None)
        self._on_step = on_step or (lambda stats: None)
        self._on_abort = on_abort or (lambda request_id: None)
        self._on_early_stop = on_early_stop or (lambda request_id, arrival: None)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[RequestSink, Submission, list[float]]] = {}  # step thread only
        self._lock = threading.Lock()
        self._in_flight = 0
        self._accepting = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="deepinfer-step-loop", daemon=True)
        self.stats: dict = dict(engine.stats())  # replaced (never mutated) after every step

    # -- event-loop side --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, submission: Submission, sink: RequestSink) -> Lease:
        """Queue a request for the step thread; raises :class:`QueueFull` or :class:`Closed`.
        The caller must release the returned lease when its exchange ends, in a ``finally``."""
        with self._lock:
            if not self._accepting:
                raise Closed("the server is shutting down")
            if self._in_flight >= self.capacity:
                raise QueueFull(f"{self._in_flight} requests in flight, the limit is {self.capacity}")
            self._in_flight += 1  # the only increment; Lease.release is the only decrement
        self._commands.put(("add", submission, sink))
        return Lease(self, submission.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request early (its slot stays taken until its lease is released)."""
        self._commands.put(("abort", request_id, None))

    def stop_early(self, request_id: str) -> None:
        """End a request whose answer is complete although the engine would go on (its output
        parser found a stop sequence): freed like an abort, counted as a normal stop."""
        self._commands.put(("stop", request_id, None))

    def call(self, fn: Callable[[], object]) -> asyncio.Future:
        """Run ``fn()`` in the step thread between two steps (where reading the engine's state
        is safe); the returned future resolves to its result or its exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", (fn, loop, future), None))
        return future

    def _release(self, request_id: str) -> None:
        self.abort(request_id)  # after the request's "add" in the queue; no-op once finished
        with self._lock:
            self._in_flight -= 1

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort whatever is still running and stop the step thread."""
        self.stop_accepting()
        self._commands.put(("abort_all", None, None))
        self._stop.set()
        self._thread.join(timeout)

    # -- step thread ------------------------------------------------------------------------
    def _handle(self, kind: str, payload, sink: RequestSink | None) -> None:
        if kind == "add":
            try:
                self.engine.add_request(
                    list(payload.prompt_token_ids),
                    payload.params,
                    request_id=payload.request_id,
                    final_only=payload.final_only,
                )
            except Exception as exc:  # ValueError / TypeError: the request's fault; others: ours
                if not isinstance(exc, (ValueError, TypeError)):
                    log.exception("adding request %s failed", payload.request_id)
                sink.admit(exc)
                return
            self._sinks[payload.request_id] = (sink, payload, [payload.arrival])
            sink.admit(None)
        elif kind in ("abort", "stop"):
            entry = self._sinks.pop(payload, None)
            if entry is not None:  # None: it already finished (or ended) in the engine
                try:
                    self.engine.abort_request(payload)
                finally:
                    entry[0].close()
                    if kind == "stop":
                        self._on_early_stop(payload, entry[1].arrival)
                    else:
                        self._on_abort(payload)
        elif kind == "call":
            fn, loop, future = payload
            try:
                result, error = fn(), None
            except Exception as exc:  # handed to the caller, not the step thread's concern
                result, error = None, exc

            def resolve() -> None:
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            loop.call_soon_threadsafe(resolve)
        elif kind == "abort_all":
            for request_id in list(self._sinks):
                self._handle("abort", request_id, None)

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                self._handle(*item)
            except Exception:  # the step thread must outlive any one command
                log.exception("engine front: %s failed", item[0])
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish()  # aborts free blocks without a step: show it

    def _publish(self) -> None:
        self.stats = dict(self.engine.stats())
        self._on_step(self.stats)

    def _loop(self) -> None:
        while not self._stop.is_set() or not self._commands.empty():
            self._drain_commands(block=not self.engine.has_unfinished_requests() and not self._stop.is_set())
            if not self.engine.has_unfinished_requests():
                continue
            start = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step must not kill the server
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            now = time.monotonic()
            for out in outputs:
                entry = self._sinks.get(out.request_id)
                if entry is None:
                    continue
                sink, submission, times = entry
                timing = StepTiming(start, now, submission.arrival, len(times) == 1, times[-1])
                times.append(now)
                if out.finished:
                    del self._sinks[out.request_id]
                try:
                    self._on_output(out, timing)
                except Exception:  # metrics must not stop the stream
                    log.exception("recording the metrics of %s failed", out.request_id)
                sink.put(out)
            self._publish()

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, (sink, _, _) in list(self._sinks.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine is already in trouble; the sink still ends
                log.exception("abort of %s failed", request_id)
            sink.close(exc)
        self._sinks.clear()
