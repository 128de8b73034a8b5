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

from dataclasses import dataclass

import torch

from .batch_build import PENDING
from .model_runner import Launched
from .request import Request
from .sampler import SamplingRow, sampling_row
from .scheduler import Scheduler, SchedulerOutput, scheduled_request


class OverlapGuardError(RuntimeError):
    """A step read (or would read) a token that did not exist yet."""


@dataclass(frozen=True)
class InFlight:
    launched: Launched
    requests: tuple[Request, ...]  # the scheduled requests, by identity (ids may be reused)


def enabled(setting: bool | None, device_type: str, has_tiers: bool, has_state: bool) -> bool:
    """``None`` means on wherever the device runs asynchronously (not the CPU). Off with a
    persistent KV store or per-request state KV, whose bookkeeping runs once per committed step."""
    if has_tiers or has_state:
        return False
    return device_type != "cpu" if setting is None else bool(setting)


def continuation(scheduler: Scheduler, flight: InFlight) -> tuple[SchedulerOutput, dict[str, SamplingRow], torch.Tensor] | None:
    """Step N+1 for every request of the step in flight, fed its sampled ids on the device;
    None when the batch cannot simply continue (then step N is committed first)."""
    launched, reqs = flight.launched, flight.requests
    if launched.tokens is None or scheduler.waiting or scheduler.loading:
        return None
    if len(reqs) != len(scheduler.running) or len(reqs) > scheduler.config.max_num_batched_tokens:
        return None
    if not all(s.sample for s in launched.sched.requests) or len(launched.request_ids) != len(reqs):
        return None
    running = {id(r) for r in scheduler.running}
    for req in reqs:
        p = req.params
        if id(req) not in running or req.finished or p.logits_processors:
            return None
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            return None
        n_out = len(req.output_token_ids)
        if n_out + 1 >= req.max_tokens:  # the token in flight may be its last
            return None
        if req.num_computed_tokens != len(req.prompt_token_ids) + n_out - 1:  # step N computed up to its last known token
            return None
    kv = scheduler.kv
    for req in reqs:  # KV for the token in flight and the one this step computes
        if not kv.allocate(req, 2):
            return None
    # one pass per request, nothing per request that the batch can share (a 256-request step
    # runs this between two graph replays of ~3 ms)
    scheduled, rows = [], {}
    for req in reqs:
        p, rid, out_ids = req.params, req.request_id, req.output_token_ids
        position = req.num_computed_tokens + 1  # = req.num_tokens (checked above)
        suppressed = req.eos_token_ids + tuple(p.stop_token_ids) if len(out_ids) + 1 < p.min_tokens else ()  # counting the token in flight
        scheduled.append(scheduled_request(rid, (PENDING,), position, tuple(req.block_ids), True, req.seed, len(req.prompt_token_ids)))
        rows[rid] = sampling_row(p, req.seed, position + 1, req.prompt_token_ids, out_ids, suppressed)
    return SchedulerOutput(tuple(scheduled), len(scheduled)), rows, launched.tokens


def alive(scheduler: Scheduler, flight: InFlight, debug: bool) -> SchedulerOutput:
    """The rows of a finished step whose requests are still the ones it ran (not finished,
    aborted or replaced under the same id since), after the accounting guards."""
    kept = []
    for s, req in zip(flight.launched.sched.requests, flight.requests):
        if scheduler.requests.get(s.request_id) is not req or req.finished:
            continue
        if req.num_computed_tokens != s.start_position:
            raise OverlapGuardError(f"request {s.request_id!r}: a step starting at position {s.start_position} is committed after {req.num_computed_tokens} computed tokens")
        kept.append(s)
    if debug and flight.launched.fed is not None:
        fed = flight.launched.fed.tolist()
        offsets = {s.request_id: i for i, s in enumerate(flight.launched.sched.requests)}
        for s in kept:
            req = flight.requests[offsets[s.request_id]]
            if req.num_tokens <= s.start_position:
                raise OverlapGuardError(f"request {s.request_id!r}: the step read position {s.start_position} before its token existed ({req.num_tokens} known)")
            if fed[offsets[s.request_id]] != req.token_at(s.start_position):
                raise OverlapGuardError(f"request {s.request_id!r}: the step read token {fed[offsets[s.request_id]]} at position {s.start_position}, the request has {req.token_at(s.start_position)}")
    return SchedulerOutput(tuple(kept), sum(len(s.token_ids) for s in kept))
