"""The engine's mutable record of one request (owned by the scheduler)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or drawn at arrival: sampling noise = f(seed, position)
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 0  # resolved against the context length
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Invariant: num_computed_tokens <= num_tokens; tokens [0, num_computed_tokens) have KV in
    # the blocks of `block_ids`. A step schedules some of [num_computed_tokens, num_tokens).
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # hash chain of full known blocks
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_stored_blocks: int = 0  # leading full blocks already handed to the KV store writer
    final_only: bool = (
        False  # its caller reads only the last output (LLM.generate, non-streamed HTTP): first and last snapshot only
    )
    prompt_array: Any = field(
        default=None, repr=False
    )  # np.ndarray [n] uint32 of prompt_token_ids, from the entry check (None: not made)
    # speculative decoding (engine/spec_decode.py): drafts to verify at the next step, after the
    # last known token; never part of the known tokens (never hashed, cached or streamed)
    draft_token_ids: list[int] = field(default_factory=list)
    num_new_tokens: int = 1  # tokens the last step appended (a verify step may add several)
    num_drafts: int = 0  # verify steps with at least one draft
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # ... and accepted

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole history first (the
        scheduler and the prefix-cache keys take a slice of every request each step)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]
