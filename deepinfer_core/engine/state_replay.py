"""Rebuilding per-request state KV after a prefix-cache hit (or a resume), by replaying tokens.

A prefix hit hands a request its cached blocks (block KV), but its state KV (window rings,
compressor tails) is gone. It is a function of the layer inputs at the last few positions before
the hit, and layer ``l``'s input at position ``p`` is exact once the replay has covered ``l``
windows before ``p`` (each layer's attention looks ``window - 1`` positions back; the first
layer's input is the token embedding, exact everywhere). So re-running the model over the last
``replay_tokens`` tokens before the hit, reading block KV but never writing it, leaves the state
exactly as a full prefill would. ``replay_tokens`` comes from the model's layout; a smaller,
bounded (approximate) replay is a different number passed here.
"""

from __future__ import annotations

from .scheduler import ScheduledRequest, SchedulerOutput


def replays_needed(sched: SchedulerOutput, requests: dict, state, replay_tokens: int) -> SchedulerOutput | None:
    """The replay steps for scheduled requests that start past position 0 without a state slot
    (prefix hit or resume after preemption); None when there are none."""
    replays = []
    for s in sched.requests:
        if s.start_position == 0 or replay_tokens <= 0 or state.holds(s.request_id):
            continue
        lo = max(0, s.start_position - replay_tokens)
        tokens = requests[s.request_id].all_token_ids[lo : s.start_position]
        replays.append(ScheduledRequest(s.request_id, tuple(tokens), lo, s.block_ids, False, s.seed, s.prompt_len))
    if not replays:
        return None
    return SchedulerOutput(tuple(replays), sum(len(r.token_ids) for r in replays))
