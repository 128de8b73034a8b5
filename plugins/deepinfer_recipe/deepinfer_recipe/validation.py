"""Small request-validation helpers shared by the codecs.

Every failure raises :class:`ProtocolError` naming the offending parameter (dotted path such as
``messages[2].content``), so each codec can render it in its own error shape. ``bool`` is not
accepted where a number is expected (in Python ``True`` is an ``int``; in JSON it is not).
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Sequence

from deepinfer_core.codecs import ProtocolError

from .json_limits import LIMITS, JsonLimits, check_body

_MISSING = object()


def fail(param: str, message: str) -> ProtocolError:
    return ProtocolError(f"{param}: {message}", param=param)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_object(body: Any, param: str = "body") -> dict:
    if not isinstance(body, dict):
        raise fail(param, "must be a JSON object")
    return body


def get_str(body: dict, key: str, *, required: bool = False, param: str | None = None) -> str | None:
    value = body.get(key, _MISSING)
    name = param or key
    if value is _MISSING or value is None:
        if required:
            raise fail(name, "is required")
        return None
    if not isinstance(value, str):
        raise fail(name, f"must be a string, got {type(value).__name__}")
    return value


def get_bool(body: dict, key: str, default: bool = False, *, param: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise fail(param or key, "must be a boolean")
    return value


def get_number(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_number(value):
        raise fail(key, "must be a number")
    if not lo <= value <= hi:
        raise fail(key, f"must be between {lo:g} and {hi:g}, got {value}")
    return float(value)


def get_int(body: dict, key: str, *, lo: int | None = None, required: bool = False) -> int | None:
    value = body.get(key)
    if value is None:
        if required:
            raise fail(key, "is required")
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise fail(key, "must be an integer")
    if lo is not None and value < lo:
        raise fail(key, f"must be >= {lo}, got {value}")
    return value


def get_list(body: dict, key: str, *, required: bool = False, non_empty: bool = False) -> list | None:
    value = body.get(key)
    if value is None:
        if required:
            raise fail(key, "is required")
        return None
    if not isinstance(value, list):
        raise fail(key, "must be an array")
    if non_empty and not value:
        raise fail(key, "must not be empty")
    return value


def get_choice(
    body: dict, key: str, choices: Sequence[str], param: str | None = None, *, required: bool = False
) -> str | None:
    value = get_str(body, key, param=param, required=required)
    if value is not None and value not in choices:
        raise fail(param or key, f"must be one of {', '.join(choices)}; got {value!r}")
    return value


#: Stop sequences: at most this many, each at most this long. The streaming parser holds back
#: any suffix that could still grow into one, so their size bounds its work per delta.
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 1000


def stop_list(value: Any, param: str, limit: int | None = None, *, allow_string: bool = True) -> tuple[str, ...]:
    """Stop sequences: an array of strings (OpenAI also allows one bare string)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) and allow_string else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise fail(param, "must be a string or an array of strings" if allow_string else "must be an array of strings")
    limit = MAX_STOP_SEQUENCES if limit is None else limit
    if len(items) > limit:
        raise fail(param, f"at most {limit} stop sequences (limit)")
    for i, item in enumerate(items):
        if len(item) > MAX_STOP_LENGTH:
            raise fail(
                f"{param}[{i}]" if isinstance(value, list) else param,
                f"longer than {MAX_STOP_LENGTH} characters (limit)",
            )
    return tuple(items)


def arguments_text(text: str, param: str, limits: JsonLimits = LIMITS) -> str:
    """Tool-call arguments from a conversation's history, kept as written: DeepSeek's reference
    encoder renders JSON objects as parameters and any other text (empty, not JSON) as one
    string parameter, so non-JSON text is accepted. JSON the prompt could not carry (nested past
    the limit, NaN, an escaped lone surrogate) is refused."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise fail(param, f"nested deeper than {limits.max_depth} levels (limit)") from None
    except ValueError:
        return text
    check_body(value, param, limits)
    return text


#: OpenAI's range for a ``logit_bias`` value, and its limit on the number of entries.
LOGIT_BIAS_RANGE = (-100, 100)
MAX_LOGIT_BIAS = 300


def logit_bias(body: dict, key: str = "logit_bias") -> dict[int, float] | None:
    """``{"token id": bias}`` (JSON keys are strings), each bias in [-100, 100]; the ids are
    checked against the model's vocabulary when the request is prepared."""
    raw = body.get(key)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail(key, "must be an object mapping token ids to numbers between -100 and 100")
    if len(raw) > MAX_LOGIT_BIAS:
        raise fail(key, f"at most {MAX_LOGIT_BIAS} entries (limit)")
    out = {}
    for token, bias in raw.items():
        if not (isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 10):
            raise fail(f"{key}[{token!r}]", "keys must be token ids (non-negative integers)")
        if not is_number(bias) or not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
            raise fail(f"{key}[{token!r}]", f"must be a number between -100 and 100, got {bias!r}")
        out[int(token)] = float(bias)
    return out


def sampling_extensions(body: dict, extra: dict) -> None:
    """vLLM's sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``) and OpenAI's
    ``logit_bias``, validated into ``extra`` (the server applies each of them)."""
    if (top_k := get_int(body, "top_k", lo=-1)) is not None:
        extra["top_k"] = top_k
    if (min_p := get_number(body, "min_p", 0, 1)) is not None:
        extra["min_p"] = min_p
    if (penalty := get_number(body, "repetition_penalty", 0.01, 100)) is not None:
        extra["repetition_penalty"] = penalty
    if (bias := logit_bias(body)) is not None:
        extra["logit_bias"] = bias


def check_request(body: Any) -> dict:
    """Every codec's first step: a JSON object within the limits (see :mod:`.json_limits`)."""
    require_object(body)
    check_body(body)
    return body


def new_id(prefix: str, size: int = 24) -> str:
    """Random id in the style of each API (``chatcmpl-…``, ``msg_…``, ``call_…``)."""
    return prefix + secrets.token_hex(size // 2)
