"""The driver of a parallel engine: the caller's process, holding no model.

:class:`ParallelEngine` has the surface ``LLM`` and ``deepinfer serve`` use of an ``LLMEngine``
(``check_batch`` / ``add_checked`` / ``add_request``, ``abort_request``, ``step``,
``has_unfinished_requests``, ``stats``, ``tokenizer``, ``max_model_len``...), and behind it one
worker process per rank (:mod:`.worker`). Requests are checked here against the limits rank 0
reports, then go to the data-parallel rank with the least work (fewest unfinished requests, then
fewest queued tokens); ``step()`` returns the outputs the ranks have sent since the last call.

Failure: if a rank exits or reports a fatal error, every unfinished request ends with
``finish_reason="error"`` naming the rank and its error, the other ranks are stopped, and every
later request is refused with the same reason. The ranks' collectives are bounded by
``collective_timeout_s``, so a rank that hangs instead of exiting turns into an error too.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

from .. import validation
from ..outputs import CompletionOutput, RequestOutput
from .launch import free_port, rank_context, start_ranks
from .worker import WorkerSpec, worker_main

__all__ = ["ParallelEngine", "ParallelGroupError"]

log = logging.getLogger(__name__)
START_TIMEOUT_S = 900.0  # loading a model on every rank


class ParallelGroupError(RuntimeError):
    """The group of rank processes is down (a rank died, failed or timed out)."""


@dataclass(frozen=True)
class RemoteModel:
    """What the server reads of the model (its config and vocabulary size), as rank 0 reports."""

    config: dict
    vocab_size: int


class _Requests:
    """Unfinished request ids -> their data-parallel rank (``RequestStreams`` reads ``.requests``)."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}


@dataclass
class _Pending:
    rank: int
    prompt: str | None
    prompt_token_ids: list[int]
    queued_tokens: int


class ParallelEngine:
    def __init__(self, config, host=None) -> None:
        from ...plugin_host import default_host

        self.config = config
        host = host or default_host()
        platform = host.platform(config.device)
        self.world_size = config.world_size
        self.dp_ranks = list(range(config.data_parallel_size))  # the ranks that take requests
        spec = WorkerSpec(config, self.world_size, free_port(), platform.device_type, os.getpid())
        context = rank_context()
        self._commands = [context.Queue() for _ in range(self.world_size)]
        self._results = context.Queue()
        self._ranks = start_ranks(worker_main, self.world_size, (spec, self._commands, self._results))
        self._finalizer = weakref.finalize(self, _stop_ranks, self._ranks.processes, self._commands)
        self._down: str | None = None
        self.scheduler = _Requests()
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self.rank_stats: dict[int, dict] = {}
        self._held: list[tuple] = []  # messages read by rank_report, for the next step
        info = self._wait_ready()
        self.limits = info["limits"]
        self.max_model_len = info["max_model_len"]
        self.num_blocks = info["num_blocks"]
        self.model = RemoteModel(info["model_config"], self.limits.vocab_size)
        self.tiers = None
        self.tokenizer = _tokenizer(config.model, host)
        log.info(
            "deepinfer parallel engine: %s on %d ranks (data parallel %d, expert parallel %d, %s, %s)",
            config.model, self.world_size, config.data_parallel_size, config.expert_parallel_size,
            info["platform"], info["dtype"],
        )  # fmt: skip

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._ranks.processes]

    def _wait_ready(self) -> dict:
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ready) < self.world_size:
            try:
                kind, rank, *rest = self._results.get(timeout=0.2)
            except queue.Empty:
                self._check_alive()
                if self._down is None and time.monotonic() > deadline:
                    self._go_down(f"the ranks did not start within {START_TIMEOUT_S:.0f} s")
                if self._down is not None:
                    self.shutdown()
                    raise ParallelGroupError(self._down) from None
                continue
            if kind == "ready":
                ready[rank] = rest[0]
            elif kind == "fatal":
                self._go_down(rest[0])
                self.shutdown()
                raise ParallelGroupError(f"a rank failed to start: {rest[0]}")
        return ready[0]

    # -- requests --------------------------------------------------------------------------
    def check_batch(self, requests: Sequence[tuple[list[int], object]]) -> list[validation.CheckedRequest]:
        checked = []
        for i, (ids, params) in enumerate(requests):
            try:
                checked.append(self._check(ids, params))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
        return checked

    def _check(self, ids, params) -> validation.CheckedRequest:
        from ..sampling_params import SamplingParams

        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = params.checked()
        prompt, array = validation.checked_prompt(ids, self.limits)
        validation.check_params(params, len(prompt), self.limits)
        return validation.CheckedRequest(prompt, params, array)

    def validate(self, prompt_token_ids, params) -> None:
        self._check(prompt_token_ids, params)

    def check_prompt_text(self, text: str) -> None:
        if self.tokenizer is not None:
            validation.check_text_size(text, self.max_model_len, self.tokenizer.max_token_chars)

    def add_request(self, prompt_token_ids, params, prompt=None, request_id=None, *, final_only=False) -> str:
        return self.add_checked(self._check(prompt_token_ids, params), prompt, request_id, final_only=final_only)

    def add_checked(self, checked, prompt=None, request_id=None, *, final_only: bool = False) -> str:
        if self._down is not None:
            raise ParallelGroupError(self._down)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string or None, got {type(request_id).__name__}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in use")
        rank = min(self.dp_ranks, key=self._load_of)
        ids = list(checked.prompt_token_ids)
        self._commands[rank].put(("add", ids, checked.params, prompt, request_id, final_only))
        self._pending[request_id] = _Pending(rank, prompt, ids, len(ids) + (checked.params.max_tokens or 0))
        self.scheduler.requests[request_id] = rank
        return request_id

    def _load_of(self, rank: int) -> tuple[int, int, int]:
        mine = [p for p in self._pending.values() if p.rank == rank]
        return len(mine), sum(p.queued_tokens for p in mine), rank

    def abort_request(self, request_id: str) -> None:
        """Ask the request's rank to abort it; its final output arrives through :meth:`step`."""
        pending = self._pending.get(request_id)
        if pending is not None and self._down is None:
            self._commands[pending.rank].put(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def rebalance(self, physical_to_logical=None) -> None:
        """Re-place the experts at the next step: to ``physical_to_logical`` ([layers, slots]) when
        given, else to the plan of the load counted so far."""
        self._commands[0].put(("rebalance", None if physical_to_logical is None else physical_to_logical))

    # -- the loop ---------------------------------------------------------------------------
    def step(self, wait_s: float = 0.05) -> list[RequestOutput]:
        """The outputs the ranks sent since the last call (waiting up to ``wait_s`` for some)."""
        if self._down is not None:
            return self._fail_all()
        messages, self._held = self._held + self._read(0.0 if self._held else wait_s), []
        outputs: list[RequestOutput] = []
        for kind, rank, *rest in messages:
            if kind == "out":
                outs, stats = rest
                self.rank_stats[rank] = stats
                outputs += [out for out in outs if out.request_id in self._pending]
            elif kind == "stats":
                self.rank_stats[rank] = rest[0]
            elif kind == "fatal":
                self._go_down(rest[0])
        for out in outputs:
            if out.finished:
                self._pending.pop(out.request_id, None)
                self.scheduler.requests.pop(out.request_id, None)
        self._check_alive()
        if self._down is not None:
            outputs += self._fail_all()
        return outputs

    def _read(self, wait_s: float) -> list[tuple]:
        messages = []
        try:
            messages.append(self._results.get(timeout=wait_s) if wait_s else self._results.get_nowait())
            while True:
                messages.append(self._results.get_nowait())
        except queue.Empty:
            return messages

    def rank_report(self, timeout_s: float = 30.0) -> list[dict]:
        """Every rank's current counters (steps, busy steps, empty passes, re-placements with
        their pause, scheduler state), asked for now; outputs that arrive meanwhile wait for
        the next :meth:`step`."""
        if self._down is not None:
            raise ParallelGroupError(self._down)
        for command in self._commands:
            command.put(("stats",))
        fresh: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(fresh) < self.world_size and time.monotonic() < deadline and self._down is None:
            for message in self._read(0.05):
                if message[0] == "stats":
                    fresh[message[1]] = self.rank_stats[message[1]] = message[2]
                else:
                    self._held.append(message)
            self._check_alive()
        if len(fresh) < self.world_size:
            raise ParallelGroupError(self._down or f"only ranks {sorted(fresh)} reported within {timeout_s} s")
        return [fresh[r] for r in range(self.world_size)]

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self._ranks.processes):
            if not proc.is_alive() and self._down is None:
                self._go_down(f"rank {rank} exited (exit code {proc.exitcode})")

    def _go_down(self, reason: str) -> None:
        if self._down is None:
            self._down = f"the parallel engine's rank group is down: {reason.strip()}"
            log.error("%s", self._down)
            _stop_ranks(self._ranks.processes, self._commands, grace_s=0.0)

    def _fail_all(self) -> list[RequestOutput]:
        failed = []
        for request_id, p in list(self._pending.items()):
            error = CompletionOutput(0, "", [], "error", error=self._down)
            failed.append(RequestOutput(request_id, p.prompt, p.prompt_token_ids, [error], True))
        self._pending.clear()
        self.scheduler.requests.clear()
        return failed

    def stats(self) -> dict:
        ranks = [self.rank_stats.get(r, {}) for r in range(self.world_size)]
        return {
            "running": sum(s.get("running", 0) for s in ranks),
            "waiting": sum(s.get("waiting", 0) for s in ranks),
            "kv_usage": max((s.get("kv_usage", 0.0) for s in ranks), default=0.0),
            "prefix_cache_queries": sum(s.get("prefix_cache_queries", 0) for s in ranks),
            "prefix_cache_hits": sum(s.get("prefix_cache_hits", 0) for s in ranks),
            "preemptions": sum(s.get("preemptions", 0) for s in ranks),
            "ranks": ranks,
        }

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (idempotent); the ranks finish the step they are in."""
        _stop_ranks(self._ranks.processes, self._commands, grace_s=timeout_s)
        self._finalizer.detach()


def _stop_ranks(processes, commands, grace_s: float = 10.0) -> None:
    for command in commands:
        try:
            command.put(("stop",))
        except (ValueError, OSError):  # already closed
            pass
    deadline = time.monotonic() + grace_s
    for proc in processes:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    for command in commands:
        command.cancel_join_thread()  # never block the driver's exit on a queue nobody reads


def _tokenizer(model: str, host):
    """The model's tokenizer, read in the driver (no weights are loaded here)."""
    from ...models.loaders.formats import open_model_files
    from ..loading import resolve_model_path

    return open_model_files(resolve_model_path(model, host)).tokenizer
