"""Overlapped scheduling: the host builds step N+1 while the device still runs step N.

A decode step's host work (scheduling, building the batch, committing tokens, stop checks,
detokenizing) used to sit between two device steps. With overlap on, ``LLMEngine.step`` launches
step N+1 *before* it waits for step N's sampled ids: each request of N+1 feeds the token N
sampled straight from device memory (``PENDING`` on the host), and the host then commits N
while the device computes N+1.

Accounting for the tokens not yet copied back: nothing in the scheduler's books moves until a
step is committed. A continuation step therefore starts each request one position past its
computed count (``num_computed_tokens + 1``), reserves KV blocks for two more tokens, and samples
at ``num_tokens + 1``. Only a steady decode batch continues -- every running request sampled in
step N, nothing waits for admission, and no request's next token depends on host-side history
(penalties, logits processors) or could end it by length. Anything else commits step N first
and schedules normally. A request that step N finishes (EOS, stop string, abort) has its extra
token from N+1 dropped at commit; its blocks are freed while N+1 may still write them, which is
safe because device work runs in queue order and the written slot lies past its cached blocks.

Guards: every commit checks that each row starts where the request's computed tokens end
(always); in debug mode (``EngineConfig(overlap_debug=True)`` or ``DEEPINFER_OVERLAP_DEBUG=1``)
each device-fed input is copied back and must equal the token the request has at that position
by then -- a step that read a token before it existed fails loudly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter, is_
from typing import NamedTuple

import numpy as np
import torch

from .batch_build import PENDING, BatchColumns
from .kv_cache_manager import KVCacheManager
from .model_runner import Launched
from .request import Request, RequestStatus
from .sampler import SamplingRow, sampling_row
from .scheduler import ScheduledRequest, Scheduler, SchedulerOutput, scheduled_request


class OverlapGuardError(RuntimeError):
    """A step read (or would read) a token that did not exist yet."""


@dataclass(frozen=True)
class InFlight:
    launched: Launched
    requests: tuple[Request, ...]  # the scheduled requests, by identity (ids may be reused)
    chain: Chain | None = None  # set when the step is a continuation: what the next one may take as checked


def enabled(setting: bool | None, device_type: str, has_tiers: bool) -> bool:
    """``None`` means on wherever the device runs asynchronously (not the CPU). Off with a
    persistent KV store, whose write-back runs once per committed step.

    Per-request state KV (DeepSeek-V4's window rings and compressor tails) overlaps like block
    KV: a continuation's requests all hold their state slots already (nothing to replay), and
    every step that may need a replay is built by ``schedule()`` after the step in flight was
    committed, as in serial stepping. A slot freed at commit while the next step of its request
    is still queued is safe for the reason freed blocks are: the device runs in queue order, and
    a new owner's first step (from position 0 or a replay) rewrites the state it reads."""
    if has_tiers:
        return False
    return device_type != "cpu" if setting is None else bool(setting)


class Chain:
    """What a continuation's full check found about its requests, for the next continuation of
    the same requests (the same tuple, still the scheduler's running list in that order), which
    then checks nothing per request.

    Why it holds: between two continuations of one chain the engine commits exactly one step (the
    one in flight when the first was built), and that commit gives every request it keeps one more
    output token and one more computed position, or finishes it (EOS, stop, error, abort), which
    takes it off the running list and breaks the chain (the identity check). Nothing else changes a
    running request meanwhile: no ``schedule()`` runs (no admission, no preemption), and params
    are the engine's own copy. So the per-request facts carry over with every count one further:
    penalties and logits processors stay absent, ``num_computed_tokens`` stays one behind the
    known tokens (and every commit checks that anyway, :func:`alive`), a request's length limit
    comes one step closer (``steps_left``, the steps every request still has before its token in
    flight may be its last), ``min_tokens`` bans nothing any more once it banned nothing at the
    first step, and the KV blocks last until a request crosses a block boundary (``room``, the
    steps until the first one does; only then are blocks allocated, as the full check does).
    test_overlap_chain checks these against the full check step by step."""

    __slots__ = ("steps_left", "room", "plain", "ids", "seeds", "prompt_lens", "block_tuples", "tables", "nblocks")

    @classmethod
    def first(cls, kv: KVCacheManager, reqs: tuple[Request, ...], plain: bool) -> Chain:
        """After a full check (blocks for this step allocated): ``plain``, every row greedy with
        nothing banned from now on."""
        c = cls()
        c.steps_left = (
            min(r.max_tokens - len(r.output_token_ids) for r in reqs) - 2
        )  # the full check passed at n_out + 1 < max_tokens
        c.plain = plain
        c.ids = tuple(r.request_id for r in reqs)
        c.seeds = tuple(r.seed for r in reqs)
        c.prompt_lens = tuple(len(r.prompt_token_ids) for r in reqs)
        c._blocks(kv.block_size, reqs)
        return c

    def next(self, kv: KVCacheManager, reqs: tuple[Request, ...]) -> Chain | None:
        """The chain one step further, blocks allocated where a request needs one (None: the
        pool ran dry, as the full check would have found)."""
        c = Chain()
        c.steps_left, c.room, c.plain = self.steps_left - 1, self.room - 1, self.plain
        c.ids, c.seeds, c.prompt_lens = self.ids, self.seeds, self.prompt_lens
        c.block_tuples, c.tables, c.nblocks = self.block_tuples, self.tables, self.nblocks
        if c.room < 0:  # a request crosses a block boundary: the full check's allocation
            for req in reqs:
                if not kv.allocate(req, 2):
                    return None
            c._blocks(kv.block_size, reqs)
        return c

    def _blocks(self, bs: int, reqs: tuple[Request, ...]) -> None:
        blocks = [r.block_ids for r in reqs]
        self.block_tuples = tuple(map(tuple, blocks))
        self.nblocks = nblocks = np.fromiter(map(len, blocks), np.int64, len(blocks))
        self.tables = np.zeros((len(blocks), max(1, int(nblocks.max()))), np.int64)  # as batch_build lays them out
        for i, b in enumerate(blocks):
            self.tables[i, : len(b)] = b
        # steps until some request needs a block more: this step computes num_computed + 1 and reserves + 2
        self.room = int((nblocks * bs - np.fromiter(map(_computed, reqs), np.int64, len(reqs))).min()) - 2


class Continuation(NamedTuple):
    sched: SchedulerOutput
    rows: Mapping[str, SamplingRow]
    fed: torch.Tensor  # the step in flight's sampled ids, on the device: this step's input ids
    chain: Chain


class ContinuationRows(Mapping):
    """A continuation's sampling rows (request id -> :class:`SamplingRow`), each built when first
    read, as LLMEngine._sampling_rows builds them. ``plain_greedy``: every row is greedy with
    no penalties, processors or banned tokens, so the runner takes the argmax without reading any
    (256 rows built and checked a step were a tenth of the 256-request step's host time)."""

    __slots__ = ("_reqs", "_ids", "_positions", "plain_greedy", "_index", "_made")

    def __init__(
        self, reqs: tuple[Request, ...], ids: tuple[str, ...], positions: list[int], plain_greedy: bool
    ) -> None:
        self._reqs, self._ids, self._positions, self.plain_greedy = reqs, ids, positions, plain_greedy
        self._index: dict[str, int] | None = None
        self._made: dict[str, SamplingRow] = {}

    def __getitem__(self, request_id: str) -> SamplingRow:
        row = self._made.get(request_id)
        if row is None:
            if self._index is None:
                self._index = {rid: i for i, rid in enumerate(self._ids)}
            i = self._index[request_id]
            req, position = self._reqs[i], self._positions[i]
            p = req.params
            n_out = position - len(req.prompt_token_ids)  # outputs known when the step was built
            suppressed = (
                req.eos_token_ids + tuple(p.stop_token_ids) if n_out + 1 < p.min_tokens else ()
            )  # counting the token in flight
            row = self._made[request_id] = sampling_row(
                p, req.seed, position + 1, req.prompt_token_ids, req.output_token_ids, suppressed
            )
        return row

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def continuation(scheduler: Scheduler, flight: InFlight) -> Continuation | None:
    """Step N+1 for every request of the step in flight, fed its sampled ids on the device;
    None when the batch cannot simply continue (then step N is committed first)."""
    launched, reqs = flight.launched, flight.requests
    if launched.tokens is None or scheduler.waiting or scheduler.loading:
        return None
    running = scheduler.running
    if (
        len(reqs) != len(running)
        or len(reqs) > scheduler.config.max_num_batched_tokens
        or len(launched.request_ids) != len(reqs)
    ):
        return None
    chain = flight.chain
    if chain is not None and chain.steps_left > 0 and all(map(is_, reqs, running)):
        # the same requests, in the scheduler's order, as the continuation that made ``chain``
        # checked: every check below still holds (see Chain), only the positions moved on
        chain = chain.next(scheduler.kv, reqs)
        if chain is None:  # the KV pool ran dry
            return None
        return _launchable(reqs, chain, launched.tokens)
    if not all(s.sample for s in launched.sched.requests):
        return None
    ids = set(map(id, running))
    plain = True
    for req in reqs:
        p = req.params
        if id(req) not in ids or req.finished or p.logits_processors:
            return None
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            return None
        n_out = len(req.output_token_ids)
        if n_out + 1 >= req.max_tokens:  # the token in flight may be its last
            return None
        if (
            req.num_computed_tokens != len(req.prompt_token_ids) + n_out - 1
        ):  # step N computed up to its last known token
            return None
        plain = plain and p.greedy and n_out + 1 >= p.min_tokens  # min_tokens suppresses nothing from here on
    kv = scheduler.kv
    for req in reqs:  # KV for the token in flight and the one this step computes
        if not kv.allocate(req, 2):
            return None
    return _launchable(reqs, Chain.first(kv, reqs, plain), launched.tokens)


def _launchable(reqs: tuple[Request, ...], chain: Chain, fed: torch.Tensor) -> Continuation:
    # one pass per request, nothing per request that the batch can share (a 256-request step
    # runs this between two graph replays of ~3 ms)
    positions = [n + 1 for n in map(_computed, reqs)]  # = req.num_tokens (checked above)
    scheduled = tuple(map(_record, chain.ids, positions, chain.block_tuples, chain.seeds, chain.prompt_lens))
    columns = BatchColumns(np.array(positions, np.int64), chain.tables, chain.nblocks, chain.prompt_lens, chain.ids)
    rows = ContinuationRows(reqs, chain.ids, positions, chain.plain)
    return Continuation(SchedulerOutput(scheduled, len(scheduled), columns=columns), rows, fed, chain)


def _record(rid: str, position: int, blocks: tuple[int, ...], seed: int, prompt_len: int) -> ScheduledRequest:
    return scheduled_request(rid, _PENDING1, position, blocks, True, seed, prompt_len)


_PENDING1 = (PENDING,)
_computed = attrgetter("num_computed_tokens")


def alive(scheduler: Scheduler, flight: InFlight, debug: bool) -> SchedulerOutput:
    """The rows of a finished step whose requests are still the ones it ran (not finished,
    aborted or replaced under the same id since), after the accounting guards."""
    sched = flight.launched.sched
    if not debug and _all_alive(scheduler, sched, flight.requests):
        return SchedulerOutput(sched.requests, sched.num_tokens)
    kept = []
    for s, req in zip(sched.requests, flight.requests):
        if scheduler.requests.get(s.request_id) is not req or req.finished:
            continue
        if req.num_computed_tokens != s.start_position:
            raise OverlapGuardError(
                f"request {s.request_id!r}: a step starting at position {s.start_position} is committed after "
                f"{req.num_computed_tokens} computed tokens"
            )
        kept.append(s)
    if debug and flight.launched.fed is not None:
        fed = flight.launched.fed.tolist()
        offsets = {s.request_id: i for i, s in enumerate(flight.launched.sched.requests)}
        for s in kept:
            req = flight.requests[offsets[s.request_id]]
            if req.num_tokens <= s.start_position:
                raise OverlapGuardError(
                    f"request {s.request_id!r}: the step read position {s.start_position} before its token existed "
                    f"({req.num_tokens} known)"
                )
            if fed[offsets[s.request_id]] != req.token_at(s.start_position):
                raise OverlapGuardError(
                    f"request {s.request_id!r}: the step read token {fed[offsets[s.request_id]]} at position "
                    f"{s.start_position}, the request has {req.token_at(s.start_position)}"
                )
    return SchedulerOutput(tuple(kept), sum(len(s.token_ids) for s in kept))


def _all_alive(scheduler: Scheduler, sched: SchedulerOutput, reqs: tuple[Request, ...]) -> bool:
    """Every row's request is still the one it ran, unfinished, and starts where its computed
    tokens end (:func:`alive`'s checks, over the batch in C loops; False: some row is not, and
    :func:`alive` sorts them out one by one)."""
    records = sched.requests
    if len(records) != len(reqs):
        return False
    ids = sched.columns.ids if sched.columns is not None else tuple(map(_request_id, records))
    return (
        all(map(is_, map(scheduler.requests.get, ids), reqs))
        and RequestStatus.FINISHED not in map(_status, reqs)
        and list(map(_computed, reqs)) == list(map(_start, records))
    )


_request_id = attrgetter("request_id")
_start = attrgetter("start_position")
_status = attrgetter("status")
