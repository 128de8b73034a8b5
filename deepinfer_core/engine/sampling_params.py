"""Per-request sampling parameters, validated on construction (vLLM-compatible names)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters (``top_k=-1``,
    vLLM's spelling, is accepted and stored as 0).
    ``seed`` makes sampling reproducible per request: the noise for a token depends only on
    (seed, position), never on what else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n == 1, "n", self.n, "only n=1 is supported (send the prompt several times)")
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, value, "must be in [-2, 2]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be an integer >= 1")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids, "must be token ids >= 0")
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", self.seed, "must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


def _check(ok: bool, name: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}={value!r}: {rule}")
