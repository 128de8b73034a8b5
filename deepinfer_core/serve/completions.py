"""The builtin codec: OpenAI's legacy Completions API (``POST /v1/completions``), plain prompts.

The prompt is a string or a list of token ids; it travels in ``ConversationRequest.extra
["prompt"]`` (no messages), which tells the server to skip chat formatting. ``ignore_eos`` (vLLM's
extension) is accepted, so load benchmarks can ask for fixed output lengths. Errors use the
OpenAI envelope, like the recipe's OpenAI codecs.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Iterable, Iterator

from ..codecs import ConversationRequest, ParsedOutput, ProtocolError


def _fail(param: str, message: str) -> ProtocolError:
    return ProtocolError(f"{param}: {message}", param=param)


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise _fail(key, f"must be a number between {lo:g} and {hi:g}")
    return float(value)


def _int(body: dict, key: str, lo: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        raise _fail(key, "must be an integer" + (f" >= {lo}" if lo is not None else ""))
    return value


def _logit_bias(raw: Any) -> dict[int, float] | None:
    if raw is None:
        return None
    rule = "must be an object mapping token ids to numbers between -100 and 100 (at most 300 entries)"
    if not isinstance(raw, dict) or len(raw) > 300:
        raise _fail("logit_bias", rule)
    out = {}
    for token, bias in raw.items():
        if not (isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 10):
            raise _fail("logit_bias", f"key {token!r}: keys must be token ids (non-negative integers)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise _fail("logit_bias", f"[{token!r}]: {rule}")
        out[int(token)] = float(bias)
    return out


def _prompt(raw: Any) -> str | list[int]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str) and raw:
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
        return list(raw)
    raise _fail("prompt", "must be a non-empty string or a non-empty array of token ids (one prompt per request)")


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class CompletionsCodec:
    name = "openai.completions"
    routes = (("POST", "/v1/completions"),)

    def parse_request(self, body: dict) -> ConversationRequest:
        if not isinstance(body, dict):
            raise _fail("body", "must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise _fail("model", "is required and must be a string")
        if _int(body, "n", 1) not in (None, 1):
            raise _fail("n", "only n=1 is supported")
        for unsupported in ("echo", "logprobs", "suffix", "best_of"):
            if body.get(unsupported) not in (None, False, 1 if unsupported == "best_of" else None):
                raise _fail(unsupported, "is not supported")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise _fail("stop", "must be a string or an array of at most 4 non-empty strings")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _fail("stream", "must be a boolean")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise _fail("stream_options", "must be an object")
        extra: dict = {"prompt": _prompt(body.get("prompt")), "stream_options": options or {}}
        ignore_eos = body.get("ignore_eos", False)  # vLLM's extension: benchmarks need fixed lengths
        if not isinstance(ignore_eos, bool):
            raise _fail("ignore_eos", "must be a boolean")
        extra["ignore_eos"] = ignore_eos
        if (min_tokens := _int(body, "min_tokens", 0)) is not None:  # vLLM's extension too
            extra["min_tokens"] = min_tokens
        for key in ("presence_penalty", "frequency_penalty"):
            if (value := _number(body, key, -2, 2)) is not None:
                extra[key] = value
        # vLLM's sampling extensions and OpenAI's logit_bias: validated here, applied by the server
        if (top_k := _int(body, "top_k", -1)) is not None:
            extra["top_k"] = top_k
        for key, lo, hi in (("min_p", 0, 1), ("repetition_penalty", 0.01, 100)):
            if (value := _number(body, key, lo, hi)) is not None:
                extra[key] = value
        if (bias := _logit_bias(body.get("logit_bias"))) is not None:
            extra["logit_bias"] = bias
        return ConversationRequest(
            messages=(),
            model=model,
            max_tokens=16 if body.get("max_tokens") is None else _int(body, "max_tokens", 1),  # the API's default
            temperature=_number(body, "temperature", 0, 2),
            top_p=_number(body, "top_p", 0, 1),
            stop=tuple(stops),
            stream=stream,
            seed=_int(body, "seed"),
            extra=extra,
        )

    @staticmethod
    def _usage(usage: dict) -> dict:
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0))},
        }

    def _base(self, request: ConversationRequest) -> dict:
        return {
            "id": request.extra.get("request_id") or "cmpl-" + secrets.token_hex(12),
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.model,
        }

    def render(self, request: ConversationRequest, result: ParsedOutput, usage: dict, finish_reason: str) -> dict:
        choice = {
            "index": 0,
            "text": result.content,
            "logprobs": None,
            "finish_reason": "length" if finish_reason == "length" else "stop",
        }
        return {**self._base(request), "choices": [choice], "usage": self._usage(usage)}

    def stream(self, request: ConversationRequest, events: Iterable[ParsedOutput]) -> Iterator[str]:
        base = self._base(request)
        finish, usage = "stop", {}
        for event in events:
            if event.content:
                yield _sse(
                    {**base, "choices": [{"index": 0, "text": event.content, "logprobs": None, "finish_reason": None}]}
                )
            finish = event.finish_reason or finish
            usage = event.usage if event.usage is not None else usage
        yield _sse(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "logprobs": None,
                        "finish_reason": "length" if finish == "length" else "stop",
                    }
                ],
            }
        )
        if request.extra.get("stream_options", {}).get("include_usage"):
            yield _sse({**base, "choices": [], "usage": self._usage(usage)})
        yield "data: [DONE]\n\n"

    def render_error(self, error: ProtocolError) -> tuple[int, dict]:
        kind = {404: "not_found_error", 429: "rate_limit_error"}.get(
            error.status, "server_error" if error.status >= 500 else "invalid_request_error"
        )
        code = error.code if error.code != kind else None
        return error.status, {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}

    def error_frame(self, error: ProtocolError) -> str:
        return _sse(self.render_error(error)[1])
