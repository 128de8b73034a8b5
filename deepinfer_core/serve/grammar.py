"""Structured output with xgrammar: a request's grammar becomes a logits processor.

The processor is per request (one ``GrammarMatcher`` each) and plugs into the sampler's
per-request seam (``SamplingParams.logits_processors``): before a token is chosen it catches the
matcher up with the tokens generated so far and masks every token the grammar forbids, so the
other requests of the batch are untouched. When the grammar is complete only the stop tokens
remain allowed, and the engine ends the request as usual.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from ..codecs import ProtocolError


def _vocab_type(backend) -> Any:
    """xgrammar's vocabulary type from a ``tokenizers`` backend's decoder (how token strings
    map to bytes): byte-level BPE, byte fallback (``<0x0A>``), or raw strings."""
    import xgrammar as xgr

    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


#: What a schema leaves unbounded is bounded (llama.cpp caps integer digits the same way): a
#: small model can write digits, or characters of a string, until ``max_tokens`` cuts the reply
#: and it is not JSON. Integers and numbers get at most 15 integer digits; strings without a
#: length, pattern or format at most MAX_STRING_LENGTH characters.
MAX_INTEGER_DIGITS = 15
MAX_STRING_LENGTH = 4096
_NUMBER_BOUND = 10**MAX_INTEGER_DIGITS - 1
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")


def bounded_schema(schema: Any) -> Any:
    """A copy of ``schema`` with :data:`MAX_INTEGER_DIGITS` and :data:`MAX_STRING_LENGTH`
    added where it leaves integers, numbers or strings unbounded (bounds it sets are kept)."""
    if isinstance(schema, list):
        return [bounded_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded_schema(value) for key, value in schema.items()}
    kinds = out.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if kinds & {"integer", "number"} and "enum" not in out and "const" not in out:
        if not any(key in out for key in _LOWER):
            out["minimum"] = -_NUMBER_BOUND
        if not any(key in out for key in _UPPER):
            out["maximum"] = _NUMBER_BOUND
    if "string" in kinds and not any(key in out for key in ("maxLength", "pattern", "format", "enum", "const")):
        out["maxLength"] = MAX_STRING_LENGTH
    return out


class GrammarProcessor:
    """``(output_token_ids, logits[V]) -> logits[V]`` for one request."""

    def __init__(self, compiled, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self._history: list[int] = []  # the tokens the matcher has accepted, in order

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        # Speculative decoding asks with the history plus drafts, then with the history plus the
        # accepted ones: roll the matcher back to the common prefix, then catch up.
        hist = self._history
        common = min(len(hist), len(output_token_ids))
        if hist[:common] != list(output_token_ids[:common]):
            common = next(i for i in range(common) if hist[i] != output_token_ids[i])
        if common < len(hist):
            self.matcher.rollback(len(hist) - common)
            del hist[common:]
        for token in output_token_ids[common:]:
            if not self.matcher.accept_token(token):
                # a draft the grammar forbids: nothing may follow it (its verification stops
                # before this row; a sampled token never gets here, the mask allowed it)
                return torch.full_like(logits, float("-inf"))
            hist.append(token)
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits.unsqueeze(0)  # [1, V]
        self._xgr.apply_token_bitmask_inplace(row, self.bitmask.to(logits.device), vocab_size=self.vocab_size)
        return row[0]


class GrammarCompiler:
    """Compiles response formats for one tokenizer (xgrammar caches compiled grammars)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        vocab = tokenizer.backend.get_vocab()  # token string -> id
        encoded = [""] * vocab_size
        for token, token_id in vocab.items():
            if token_id < vocab_size:
                encoded[token_id] = token
        info = xgr.TokenizerInfo(
            encoded, _vocab_type(tokenizer.backend), vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def json_schema(self, schema: Any, param: str) -> GrammarProcessor:
        """A processor for JSON matching ``schema``; a schema xgrammar cannot compile is a
        400 naming ``param`` and xgrammar's reason."""
        if not isinstance(schema, dict):
            raise ProtocolError(f"{param}: must be a JSON object (a JSON schema)", param=param)
        try:
            compiled = self._compiler.compile_json_schema(
                json.dumps(bounded_schema(schema)), any_whitespace=False, strict_mode=True
            )
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
            raise ProtocolError(f"{param}: the JSON schema cannot be compiled: {exc}", param=param) from None
        return GrammarProcessor(compiled, self.vocab_size)

    def compiles(self, schema: Any) -> bool:
        """Whether xgrammar can compile ``schema`` (compiled grammars are cached, so the
        structural tag that embeds it later costs little more)."""
        try:
            self._compiler.compile_json_schema(
                json.dumps(bounded_schema(schema)), any_whitespace=False, strict_mode=True
            )
        except Exception:  # xgrammar's reason is not needed: the caller decides what to do
            return False
        return True

    def structural_tag(self, tag: Any, param: str) -> GrammarProcessor:
        """A processor for an xgrammar structural tag (tool calls); a failure is a 400."""
        try:
            compiled = self._compiler.compile_structural_tag(tag)
        except Exception as exc:
            raise ProtocolError(f"{param}: the tool-call grammar cannot be compiled: {exc}", param=param) from None
        return GrammarProcessor(compiled, self.vocab_size)

    def json_object(self) -> GrammarProcessor:
        """Any JSON object, without free whitespace (a small model could pad it forever)."""
        return self.json_schema({"type": "object"}, "response_format")
