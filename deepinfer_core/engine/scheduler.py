"""Continuous batching without prefill/decode phases.

Every request has ``num_computed_tokens`` catching up with its known tokens (prompt + output).
Each step hands out a token budget: running requests first (decode, or the next chunk of a
long prompt), then waiting ones (after a prefix-cache lookup). When the KV pool runs dry, the
newest running request is preempted: its blocks are freed and it is recomputed later (its
computed full blocks usually stay in the prefix cache, so the recompute is cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]  # the tokens whose KV this step computes
    start_position: int  # position of token_ids[0]
    block_ids: tuple[int, ...]
    sample: bool  # the step reaches the last known token: sample the next one
    seed: int
    prompt_len: int = 0  # the request's prompt tokens (0: unknown), see AttentionMetadata.prompt_lens
    # token_ids as a uint32 array where they lie in the prompt (a view of Request.prompt_array);
    # None: build from token_ids
    token_array: Any = field(default=None, compare=False, repr=False)
    # speculative drafts at the end of token_ids (verified: each of the last num_spec + 1 rows samples)
    num_spec: int = 0


def scheduled_request(request_id: str, token_ids: tuple[int, ...], start_position: int, block_ids: tuple[int, ...],
                      sample: bool, seed: int, prompt_len: int = 0,
                      token_array: Any = None, num_spec: int = 0) -> ScheduledRequest:  # fmt: skip
    """``ScheduledRequest(...)`` for the per-request paths of every step: the frozen dataclass's
    generated ``__init__`` sets each field through ``object.__setattr__`` (1.9 us here, 512 of
    these and :func:`.sampler.sampling_row` a 256-request step); filling the instance dict is
    0.5 us. Same object (equality, hash, repr); test_fast_dataclass_constructors checks the fields."""
    obj = _new(ScheduledRequest)
    d = obj.__dict__
    d["request_id"], d["token_ids"], d["start_position"], d["block_ids"] = (
        request_id,
        token_ids,
        start_position,
        block_ids,
    )
    d["sample"], d["seed"], d["prompt_len"], d["token_array"] = sample, seed, prompt_len, token_array
    d["num_spec"] = num_spec
    return obj


_new = object.__new__


@dataclass(frozen=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    num_tokens: int
    preempted: tuple[str, ...] = ()
    # the decode rows' layout as arrays, already known to whoever built ``requests``
    # (batch_build.BatchColumns; None: read it from ``requests``)
    columns: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget
    long_prefill_threshold: int = 512  # a prefill chunk is capped here while others decode


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, tiers=None) -> None:
        self.config = config
        self.kv = kv
        self.tiers = tiers  # engine.kv_tiers.KVTiers when a persistent KV store is on
        self.loading: list[Request] = []  # waiting on store -> host loads, set aside
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.on_release = None  # callable(request) at preemption and finish: speculative decoding's drafter state

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted: list[str] = []

        # 1. running requests, oldest first; preempt the newest when blocks run out
        queue = list(self.running)
        i = 0
        while i < len(queue) and budget > 0:
            req = queue[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            if req.draft_token_ids:  # a decode step with drafts: verify what the budget allows
                if num_new == 1:
                    num_new += min(len(req.draft_token_ids), budget - 1)
                else:
                    req.draft_token_ids = []
            if self.kv.allocate(req, num_new):
                chosen.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            victim = queue.pop()  # newest
            self._preempt(victim)
            preempted.append(victim.request_id)
        # 2. waiting requests, in arrival order (preempted ones are at the front)
        if self.tiers is not None:
            self._resume_loaded()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            req = self.waiting[0]
            hits = self.kv.match_prefix(req)
            if self.tiers is not None:
                hits = self.tiers.admit(req, hits)
                if hits is None:  # its blocks are loading from the store: the others go on
                    self.loading.append(self.waiting.popleft())
                    continue
            cached = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - cached, budget)
            if chosen and num_new > self.config.long_prefill_threshold:
                num_new = self.config.long_prefill_threshold
            if not self.kv.allocate(req, num_new, hits):
                break
            self.waiting.popleft()
            req.num_computed_tokens = cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = cached
                self.kv.queries += len(req.prompt_token_ids)
                self.kv.hits += cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen.append((req, num_new))
            budget -= num_new

        scheduled = tuple(
            _scheduled(req, n) if not req.draft_token_ids else _scheduled_with_drafts(req, n) for req, n in chosen
        )
        return SchedulerOutput(scheduled, sum(n for _, n in chosen), tuple(preempted))

    def _resume_loaded(self) -> None:
        """Requests whose store loads finished go back to the front of the queue."""
        if self.loading and not self.running and not self.waiting:
            self.tiers.wait_for_loads(timeout=0.05)  # nothing else to do: don't spin
        ready = [r for r in self.loading if not self.tiers.loading(r.request_id)]
        for req in reversed(ready):
            self.loading.remove(req)
            self.waiting.appendleft(req)

    def _preempt(self, req: Request) -> None:
        req.draft_token_ids = []
        if self.on_release is not None:
            self.on_release(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def update(
        self, out: SchedulerOutput, sampled: dict[str, int], verified: dict[str, list[int]] | None = None
    ) -> list[Request]:
        """Commit a step: advance computed counts, append sampled tokens (``verified``: a verify
        step's accepted drafts and its one correction or bonus token, per request), publish full
        blocks, finish requests. Returns the requests that changed (for output processing)."""
        verified = verified or {}
        changed = []
        publish = self.kv.cache_computed_blocks if self.kv.enabled else None  # prefix caching off: nothing to publish
        for sched in out.requests:
            req = self.requests[sched.request_id]
            if sched.num_spec:  # a verify step: the last known token and the accepted drafts have KV
                emitted = verified.get(sched.request_id)
                req.draft_token_ids = []
                if emitted is None:  # failed: nothing is committed
                    continue
                req.num_computed_tokens += len(emitted)
                req.output_token_ids.extend(emitted)
                req.num_new_tokens = len(emitted)
                req.num_drafts += 1
                req.num_draft_tokens += sched.num_spec
                req.num_accepted_tokens += len(emitted) - 1
                if publish is not None:
                    publish(req)
                changed.append(req)
                continue
            req.num_computed_tokens += len(sched.token_ids)
            if publish is not None:
                publish(req)
            if sched.request_id in sampled:
                req.output_token_ids.append(sampled[sched.request_id])
                req.num_new_tokens = 1
                changed.append(req)
        return changed

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        if req.finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if self.on_release is not None:
            self.on_release(req)
        if self.tiers is not None:
            self.tiers.forget(req.request_id)
        if req in self.loading:
            self.loading.remove(req)
        elif req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        del self.requests[req.request_id]

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req


def _scheduled(req: Request, n: int) -> ScheduledRequest:
    start = req.num_computed_tokens
    return scheduled_request(
        req.request_id,
        tuple(req.token_slice(start, start + n)),
        start,
        tuple(req.block_ids),
        start + n == req.num_tokens,
        req.seed,
        len(req.prompt_token_ids),
        _prompt_view(req, start, n),
    )


def _scheduled_with_drafts(req: Request, n: int) -> ScheduledRequest:
    """The last known token and the first ``n - 1`` drafts (the budget may cut them)."""
    drafts = req.draft_token_ids[: n - 1]
    req.draft_token_ids = drafts
    start = req.num_computed_tokens
    return scheduled_request(
        req.request_id,
        (req.token_at(start), *drafts),
        start,
        tuple(req.block_ids),
        True,
        req.seed,
        len(req.prompt_token_ids),
        None,
        len(drafts),
    )


def _prompt_view(req: Request, start: int, n: int):
    """The scheduled ids as a view of the prompt's array, when they all lie in the prompt."""
    array = req.prompt_array
    return array[start : start + n] if array is not None and start + n <= len(req.prompt_token_ids) else None
