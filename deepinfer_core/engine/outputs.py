"""What the public API returns (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    delta_text: str = ""  # new since the previous streamed snapshot
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # why the engine gave up on this request (finish_reason "error")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # speculative decoding on: {"spec_num_drafts": verify steps with drafts, "spec_num_draft_tokens":
    # drafts verified, "spec_num_accepted_tokens": drafts accepted}; None when it is off
    metrics: dict | None = None
