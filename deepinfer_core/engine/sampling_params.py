"""Per-request sampling parameters, validated on construction (vLLM-compatible names).

Validation is total: every field is checked for type and range, numbers of other numeric types
(numpy scalars) are converted to plain ``int``/``float``, and a bad value raises one error that
names the field and what is allowed (``TypeError`` for a wrong type, ``ValueError`` for a value
out of range). The object stays mutable like vLLM's, so the engine never trusts it after the
fact: it takes a re-validated private copy (:meth:`SamplingParams.checked`) when a request
enters, and later changes to the caller's object cannot reach a running request.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

from ..kv_store import RETENTION_SECONDS

# Below this temperature sampling is greedy: dividing float32 logits by a temperature near the
# float32 limits overflows to inf and the softmax to NaN (vLLM uses the same threshold).
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # outside it a float32 logit over/underflows
MAX_TOKEN_ID = 2**31 - 1  # larger ids cannot index a tensor row on every backend
_SEED_RANGE = (-(2**63), 2**64)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature=0`` is greedy (so is any temperature below 1e-5). ``top_k=0`` and ``top_p=1``
    disable those filters (``top_k=-1``, vLLM's spelling, is accepted and stored as 0).
    ``seed`` makes sampling reproducible per request: the noise for a token depends only on
    (seed, position), never on what else is in the batch. ``max_tokens`` defaults to 16, like
    vLLM's; ``None`` means "until the context is full".
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
    # Per-request ``fn(output_token_ids, logits[V]) -> logits[V]``, applied before sampling to
    # this request's row only (vLLM's v0 signature); structured output plugs in here.
    logits_processors: list = field(default_factory=list)
    kv_retention: str = "chat"  # how long this prompt's KV stays in a persistent store (agent: 3 days, chat: 7)

    def __post_init__(self) -> None:
        self.n = _integer("n", self.n, 1, 1, "only n=1 is supported (send the prompt several times)")
        self.temperature = _real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = _integer("top_k", self.top_k, -1, None, "an integer >= 0 (0 or -1 disable it)")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _real("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        if self.seed is not None:
            self.seed = _integer(
                "seed", self.seed, _SEED_RANGE[0], _SEED_RANGE[1] - 1, "an integer in [-2**63, 2**64) or None"
            )
        if self.max_tokens is not None:
            self.max_tokens = _integer("max_tokens", self.max_tokens, 1, None, "an integer >= 1 or None")
        self.min_tokens = _integer(
            "min_tokens", self.min_tokens, 0, self.max_tokens, f"an integer in [0, max_tokens={self.max_tokens}]"
        )
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"invalid sampling parameter {name}={getattr(self, name)!r}: must be True or False")
        if not isinstance(self.logits_processors, (list, tuple)) or not all(
            callable(f) for f in self.logits_processors
        ):
            _fail(
                "logits_processors",
                self.logits_processors,
                "a list of callables fn(output_token_ids, logits) -> logits",
                TypeError,
            )
        self.logits_processors = list(self.logits_processors)
        if not isinstance(self.kv_retention, str) or self.kv_retention not in RETENTION_SECONDS:
            _fail("kv_retention", self.kv_retention, f"one of {sorted(RETENTION_SECONDS)}")

    def checked(self) -> "SamplingParams":
        """A re-validated private copy: what the engine keeps for a request (fields may have
        been changed since construction, and may change again while the request runs)."""
        if not isinstance(self, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(self).__name__}")
        return dataclasses.replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _fail(name: str, value, rule: str, exc: type[Exception] = ValueError) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise exc(f"invalid sampling parameter {name}={shown}: must be {rule}")


def _real(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    # plain floats and ints skip the abstract-class checks and the message (each request's
    # params are validated twice: ~1.5 ms of host time before a 64-request prefill's first kernel)
    if (
        type(value) is not float
        and type(value) is not int
        and (isinstance(value, bool) or not isinstance(value, numbers.Real))
    ):
        _fail(name, value, f"a number in {_interval(low, high, low_open)}", TypeError)
    value = float(value)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        _fail(name, value, f"a finite number in {_interval(low, high, low_open)}")
    return value


def _interval(low: float, high: float, low_open: bool) -> str:
    return f"{'(' if low_open else '['}{low:g}, {high:g}]"


def _integer(name: str, value, low: int, high: int | None, rule: str) -> int:
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        _fail(name, value, rule, TypeError)
    value = int(value)
    if value < low or (high is not None and value > high):
        _fail(name, value, rule)
    return value


def _stop_strings(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        _fail("stop", stop, "a string, a list of strings, or None", TypeError)
    for s in stop:
        if not isinstance(s, str):
            _fail("stop", stop, "a string, a list of strings, or None", TypeError)
        if not s:
            _fail("stop", stop, "non-empty strings")
    return list(stop)


def _token_ids(name: str, ids) -> list[int]:
    if ids is None:
        return []
    rule = f"a list of token ids (integers in [0, {MAX_TOKEN_ID}])"
    if not isinstance(ids, (list, tuple)):
        _fail(name, ids, rule, TypeError)
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            _fail(name, ids, rule, TypeError)
        if not 0 <= t <= MAX_TOKEN_ID:
            _fail(name, ids, rule)
        out.append(int(t))
    return out
