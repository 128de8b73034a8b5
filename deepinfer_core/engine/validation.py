"""Checks a request against the model before it enters the engine.

:class:`SamplingParams` checks what can be checked alone (types, ranges); this module checks
what depends on the model: every token id (prompt and ``stop_token_ids``) inside the vocabulary,
the prompt inside the context, the request inside the KV pool. Whatever passes here cannot
fail inside a step because of its inputs; each refusal names the field and the allowed values.
"""

from __future__ import annotations

import numbers
import struct
from dataclasses import dataclass

import numpy as np

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed every check below, as the engine's own copies (a fresh prompt list,
    a re-validated params copy): made by ``LLMEngine.check_batch`` and added by
    ``LLMEngine.add_checked`` without checking it again (each check cost ~0.1 ms of host time a
    request before a 64-request prefill's first kernel, and ``LLM`` checked every request twice)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_array: np.ndarray | None = None  # [n] uint32, the same ids (the batch builder's input)


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int  # context length in tokens (prompt + output)
    block_size: int
    num_blocks: int
    has_tokenizer: bool


def prompt_token_ids(ids, limits: ModelLimits) -> list[int]:
    """The prompt as a fresh list of plain ints, or a TypeError/ValueError naming the problem."""
    return checked_prompt(ids, limits)[0]


def checked_prompt(ids, limits: ModelLimits) -> tuple[list[int], np.ndarray]:
    """:func:`prompt_token_ids`, and the same ids as a uint32 array: made by the check's own
    packing pass, it spares the batch builder a per-token conversion of every prompt chunk."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise TypeError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    if not ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    n = len(ids)
    if n >= limits.max_model_len:
        raise ValueError(
            f"the prompt has {n} tokens but the model's context is {limits.max_model_len} tokens "
            "(the prompt must leave room for at least one new token)"
        )
    if set(map(type, ids)) == {int} and (array := _as_uint32(ids)) is not None and int(array.max()) < limits.vocab_size:
        return list(ids), array  # the common case, checked at C speed (a per-token loop cost ~1 us a token)
    wrong_type = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if wrong_type:
        raise TypeError(f"prompt token ids must be integers in [0, {limits.vocab_size}), got {_few(wrong_type)}")
    out = [int(t) for t in ids]
    bad = [t for t in out if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids outside the vocabulary [0, {limits.vocab_size}): {_few(bad)}")
    return out, np.array(out, dtype=np.uint32)


def check_params(params: SamplingParams, num_prompt_tokens: int, limits: ModelLimits) -> None:
    bad = [t for t in params.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise ValueError(
            f"invalid sampling parameter stop_token_ids: ids outside the vocabulary [0, {limits.vocab_size}): "
            f"{_few(bad)}"
        )
    if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > limits.max_model_len:
        # refused, not capped (the OpenAI and Anthropic APIs answer 400): a caller who asked for
        # N tokens learns at once that N cannot fit, instead of a "length" finish far short of N
        raise ValueError(
            context_overflow_message("max_tokens", num_prompt_tokens, params.max_tokens, limits.max_model_len)
        )
    total = min(limits.max_model_len, num_prompt_tokens + (params.max_tokens or limits.max_model_len))
    blocks = -(-total // limits.block_size)
    if blocks > limits.num_blocks:
        raise ValueError(
            f"the request needs up to {blocks} KV blocks but the cache has {limits.num_blocks}; lower max_tokens or "
            "raise kv_cache_blocks"
        )
    if params.stop and not limits.has_tokenizer:
        raise ValueError("stop strings need a tokenizer, and this model has none (use stop_token_ids)")


def context_overflow_message(param: str, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> str:
    """Why a prompt plus ``param`` (the output limit, under the caller's name for it) does not
    fit, with the numbers and the largest value that would."""
    return (
        f"invalid sampling parameter {param}={max_tokens}: the prompt has {num_prompt_tokens} tokens, and "
        f"{num_prompt_tokens} + {max_tokens} = {num_prompt_tokens + max_tokens} is more than the model's maximum "
        f"context length of {max_model_len} tokens; "
        f"set {param} to at most {max_model_len - num_prompt_tokens} or shorten the prompt"
    )


def check_text_size(text: str, max_model_len: int, max_token_chars: int) -> None:
    """Refuse a text prompt that cannot fit, before tokenizing it: no token spells more than
    ``max_token_chars`` characters, so a text longer than that many per context position has
    too many tokens whatever its content (a 12 MB prompt is refused at once, not after 17 s
    of tokenization)."""
    if len(text) > max_model_len * max_token_chars:
        raise ValueError(
            f"the prompt has {len(text)} characters, so at least {-(-len(text) // max_token_chars)} tokens, "
            f"but the model's context is {max_model_len} tokens"
        )
    check_unicode(text, "the prompt")


def check_unicode(text: str, what: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (``"\\ud800"``, possible in a Python
    string or a JSON escape) has no bytes to tokenize."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode: {exc.object[exc.start]!r} at position {exc.start} is a lone surrogate"
        ) from None


def _as_uint32(ids: list[int]) -> np.ndarray | None:
    """The ids as uint32 in one packing pass in C (min + max were two passes, ~40% of checking
    a prompt); None when one is negative or wider than 32 bits."""
    try:
        return np.frombuffer(struct.pack(f"<{len(ids)}I", *ids), np.uint32)
    except struct.error:
        return None


def _few(values: list) -> str:
    shown = ", ".join(repr(v) for v in values[:5])
    return f"[{shown}{', ...' if len(values) > 5 else ''}]"
