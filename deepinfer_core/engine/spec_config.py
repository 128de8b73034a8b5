"""``speculative_config``: parsing and checking the user's dict (or JSON text), torch-free.

``LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 5})`` and
``--speculative-config '{"method": "mtp"}'`` on every command arrive here. Keys follow vLLM's
names where vLLM has one; a mistake is a ValueError naming the key and what is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["SpecConfig", "parse_spec_config"]

METHODS = ("ngram", "mtp", "draft")
VERIFICATIONS = ("fixed", "confidence")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {
    "method": "the drafter: ngram (prompt lookup, model-free), mtp (the model's MTP block), draft (a trained head)",
    "num_speculative_tokens": f"tokens drafted per request and step, 1..{MAX_SPECULATIVE_TOKENS} (default 5)",
    "verification": "fixed (verify every draft) or confidence (DSpark: the global top-K survivals)",
    "model": "the drafter's weights (method draft): a head directory (default: the head shipped for the model)",
    "prompt_lookup_min": "n-gram: shortest suffix matched (default 1)",
    "prompt_lookup_max": "n-gram: longest suffix matched (default 4)",
    "steps_per_second": "DSpark: [[batch_tokens, steps_per_second], ...] instead of measuring this engine",
}


@dataclass(frozen=True)
class SpecConfig:
    method: str
    num_speculative_tokens: int = 5
    verification: str = "fixed"
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    steps_per_second: tuple[tuple[int, float], ...] | None = None

    def as_dict(self) -> dict:
        """What a drafter factory gets as ``config``."""
        out = {k: getattr(self, k) for k in _KEYS}
        return {k: v for k, v in out.items() if v is not None}


def _fail(message: str) -> ValueError:
    return ValueError(f"speculative_config: {message}")


def parse_spec_config(value: Any) -> SpecConfig | None:
    """``value``: None (off), a dict, or its JSON text. Returns the checked config."""
    if value is None:
        return None
    if isinstance(value, SpecConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _fail(f"not valid JSON ({exc.msg} at character {exc.pos}): {value!r}") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise _fail(f"must be a JSON object / dict, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise _fail(
            f"unknown key {unknown[0]!r}; the keys are: " + "; ".join(f"{k} ({why})" for k, why in _KEYS.items())
        )
    if "method" not in value:
        raise _fail(f"'method' is required: one of {', '.join(METHODS)}")
    method = value["method"]
    if not isinstance(method, str) or not method:
        raise _fail(f"'method' must be a name ({', '.join(METHODS)} or a plugin's drafter), got {method!r}")
    gamma = value.get("num_speculative_tokens", 5)
    if not isinstance(gamma, int) or isinstance(gamma, bool) or not 1 <= gamma <= MAX_SPECULATIVE_TOKENS:
        raise _fail(f"'num_speculative_tokens' must be a whole number in 1..{MAX_SPECULATIVE_TOKENS}, got {gamma!r}")
    verification = value.get("verification", "fixed")
    if not isinstance(verification, str) or not verification:
        raise _fail(f"'verification' must be one of {', '.join(VERIFICATIONS)}, got {verification!r}")
    model = value.get("model")
    if model is not None and not isinstance(model, str):
        raise _fail(f"'model' must be a path, got {model!r}")
    lo, hi = value.get("prompt_lookup_min", 1), value.get("prompt_lookup_max", 4)
    for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _fail(f"{name!r} must be a whole number >= 1, got {n!r}")
    if lo > hi:
        raise _fail(f"'prompt_lookup_min' ({lo}) is above 'prompt_lookup_max' ({hi})")
    curve = value.get("steps_per_second")
    if curve is not None:
        try:
            curve = tuple((int(t), float(s)) for t, s in curve)
        except (TypeError, ValueError):
            raise _fail(f"'steps_per_second' must be [[batch_tokens, steps_per_second], ...], got {curve!r}") from None
        if not curve or any(t < 1 or not s > 0 for t, s in curve):
            raise _fail("'steps_per_second' needs at least one point, each with tokens >= 1 and a rate > 0")
        curve = tuple(sorted(curve))
    return SpecConfig(method, gamma, verification, model, lo, hi, curve)
