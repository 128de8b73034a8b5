"""``POST /v1/inspect``: what the model would see for a request, without running it.

Body: ``{"request": {...}, "endpoint": "/v1/chat/completions", "output": "..."}``. ``request`` is
a body of any protocol route (``endpoint`` names it; ``model`` may be left out). The answer:

- ``prompt``: the rendered prompt as the model sees it (special tokens written out) and its
  ``tokens``: ``{id, text, special}`` each, ``text`` being what the token adds to the prompt
  (empty for a token that only completes a character the next one finishes), ``special`` true
  for the tokenizer's added tokens (control tokens and prompt markers, never text a user typed);
- ``blocks``: the prompt's full KV blocks (``block_size`` tokens) and where each is cached now:
  ``device``, ``host`` (the tiers' host pool), ``store`` (the persistent KV store) or ``null``,
  looked up along the hash chain as admission would, from metadata only;
- ``sampling``: the sampling parameters the request would run with (defaults applied);
- ``parsed``: when ``output`` (generated text) is given, what this request's output parser makes
  of it: ``content``, ``reasoning`` and ``tool_calls``.

Nothing is submitted: no step runs, no block is referenced, loaded or evicted, no counter moves.
The prompt is built by the same :class:`~.conversation.ConversationPreparer` every request goes
through, the cache is read in the step thread (between steps) so it is never seen mid-update.
Errors come in the named endpoint's own shape (a bad message is a 400 naming the field).
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..codecs import ProtocolError
from ..tokenizer import IncrementalDetokenizer

__all__ = ["InspectBody", "PromptInspector"]


class InspectBody(BaseModel):
    """The body of ``POST /v1/inspect`` (documented in /openapi.json)."""

    model_config = ConfigDict(extra="forbid")

    request: dict[str, Any] = Field(description="a request body of `endpoint` (`model` may be left out)")
    endpoint: str = Field("/v1/chat/completions", description="the protocol route `request` is written for")
    output: Optional[str] = Field(None, description="generated text to run through this request's output parser")


class PromptInspector:
    def __init__(self, server) -> None:
        self.server = server
        self.routes = {path: codec for codec in server.codecs.values() for method, path in codec.routes}

    def codec_for(self, body: Any):
        endpoint = body.get("endpoint", "/v1/chat/completions") if isinstance(body, dict) else None
        return self.routes.get(endpoint) if isinstance(endpoint, str) else None

    async def inspect(self, body: Any) -> dict:
        """The answer for ``body``; raises :class:`ProtocolError` for bad input."""
        if not isinstance(body, dict):
            raise ProtocolError("the body must be a JSON object", param="body")
        unknown = sorted(set(body) - set(InspectBody.model_fields))
        if unknown:
            raise ProtocolError(f"unknown field {unknown[0]!r} (expected request, endpoint, output)", param=unknown[0])
        codec = self.codec_for(body)
        if codec is None:
            raise ProtocolError(
                f"endpoint: not a protocol route of this server: {body.get('endpoint')!r}", param="endpoint"
            )
        request = body.get("request")
        output = body.get("output")
        if not isinstance(request, dict):
            raise ProtocolError("request: must be a JSON object (a request body of the endpoint)", param="request")
        if output is not None and not isinstance(output, str):
            raise ProtocolError("output: must be a string", param="output")
        server = self.server
        request = {"model": server.config.model_name, **request}
        conversation = codec.parse_request(request)
        prepared = await asyncio.to_thread(server.preparer.prepare, conversation)
        ids = list(prepared.prompt_token_ids)
        tiers = await asyncio.wait_for(server.front.call(lambda: self._tiers(ids)), timeout=30)
        answer = {
            "object": "inspection",
            "model": server.config.model_name,
            "endpoint": body.get("endpoint", "/v1/chat/completions"),
            "encoding": server.preparer.encoding.name if server.preparer.encoding is not None else "chat_template",
            "prompt": await asyncio.to_thread(self._prompt, ids),
            "num_tokens": len(ids),
            "max_model_len": server.engine.max_model_len,
            "thinking": prepared.thinking,
            "stop_token_ids": self._stop_ids(prepared.params),
            "sampling": _sampling(prepared.params),
            **tiers,
        }
        if output is not None:
            answer["parsed"] = _parse(prepared.new_parser(), output)
        return answer

    def _stop_ids(self, params) -> list[int]:
        """The ids that end the reply: the encoding's, and the model's end of turn (as the engine adds them)."""
        tok = self.server.engine.tokenizer
        eos = () if params.ignore_eos or tok is None else tuple(tok.stop_token_ids)
        return list(dict.fromkeys([*(params.stop_token_ids or ()), *eos]))

    def _prompt(self, ids: list[int]) -> dict:
        tok = self.server.engine.tokenizer
        if tok is None:
            return {"text": None, "tokens": [{"id": i, "text": None, "special": False} for i in ids]}
        # the tokenizer's added tokens: control tokens (<|im_start|>) and the markers a prompt
        # encoding writes whole (DeepSeek's <｜User｜>, <think>), whatever their "special" flag
        special = set(tok.backend.get_added_tokens_decoder())
        pieces = IncrementalDetokenizer(tok, skip_special_tokens=False)
        tokens = [{"id": i, "text": pieces.push(i), "special": i in special} for i in ids]
        if tokens:
            tokens[-1]["text"] += pieces.flush()
        return {"text": "".join(t["text"] for t in tokens), "tokens": tokens}

    def _tiers(self, ids: list[int]) -> dict:
        """Step thread: where each full block of ``ids`` is cached (device, host, store)."""
        engine = self.server.engine
        kv = engine.kv
        keys = kv.prefix_keys(ids)
        where: list[str | None] = [None] * len(keys)
        if kv.enabled:
            on_device = kv.cached_prefix(keys)
            where[:on_device] = ["device"] * on_device
            n = on_device
            tiers = engine.tiers
            if tiers is not None:
                while n < len(keys) and keys[n] in tiers.host:
                    where[n] = "host"
                    n += 1
                try:
                    in_store = tiers.store.match_prefix(keys[n:]) if n < len(keys) else 0
                except Exception:  # a failing store is a miss, as at admission
                    in_store = 0
                where[n : n + in_store] = ["store"] * in_store
        bs = kv.block_size
        blocks = [{"index": i, "start": i * bs, "end": (i + 1) * bs, "tier": tier} for i, tier in enumerate(where)]
        # admission never serves the last prompt token from the cache (its logits are needed)
        usable = max(0, (len(ids) - 1) // bs)
        cached = sum(1 for b in blocks[:usable] if b["tier"] is not None) * bs
        return {
            "block_size": bs,
            "prefix_caching": kv.enabled,
            "kv_store": tiers_name(engine),
            "blocks": blocks,
            "cached_tokens": cached,
        }


def tiers_name(engine) -> str | None:
    store = getattr(engine.config, "kv_store", None)
    return None if store is None else str(store)


def _sampling(params) -> dict:
    fields = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed", "max_tokens")
    out = {name: getattr(params, name, None) for name in fields}
    out["stop"] = list(params.stop or ())
    out["structured_output"] = bool(params.logits_processors)
    return out


def _parse(parser, output: str) -> dict:
    events = [parser.push(output), parser.finish()]
    return {
        "content": "".join(e.content for e in events),
        "reasoning": "".join(e.reasoning for e in events),
        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for e in events for c in e.tool_calls],
    }
