"""Chat conversations -> prompt text and token ids, with the message text kept as text.

Checks the conversation's shape first (a clear error instead of a Jinja ``UndefinedError``),
renders the model's template, and tokenizes so that special tokens come only from the template:
``<|im_start|>`` typed inside a message stays the characters ``<|im_start|>``, as DeepSeek's
own encoder does, instead of opening a turn the user was never given (a prompt injection).

How the message text is told apart from the template's: the conversation is rendered a second
time with each message's text wrapped in two private-use characters. Removing them must give
the first rendering back (else the template rewrote the text, and the request is refused when
that text holds special-token text); their positions are the spans of message text. Special
tokens are then matched only outside those spans, and everything between them is tokenized with
special-token matching off. A conversation without special-token text in its messages takes
the ordinary path, so its ids are exactly those of ``apply_chat_template(tokenize=True)``.
"""

from __future__ import annotations

import re
from typing import Any

import jinja2

from .engine.validation import check_unicode

_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_PRIVATE_USE = range(0xE000, 0xF900)


def check_conversation(conversation: Any) -> list[dict]:
    """A list of ``{"role": str, "content": str}`` dicts (other keys are passed to the
    template as they are), or a TypeError/ValueError naming the message and the field."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise TypeError(f"a conversation is a non-empty list of {{'role', 'content'}} dicts, got {_kind(conversation)}")
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise TypeError(f"message {i} is a {{'role', 'content'}} dict, got {_kind(message)}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not _ROLE.fullmatch(role):
            raise ValueError(
                f"message {i}: 'role' must be a name such as 'system', 'user' or 'assistant', got {role!r:.80}"
            )
        if not isinstance(content, str):
            raise TypeError(f"message {i}: 'content' must be a string, got {_kind(content)}")
        out.append(dict(message))
    return out


def render_chat(tokenizer, conversation: list[dict], add_generation_prompt: bool, **variables: Any) -> str:
    """``variables``: extra template variables (``tools`` for templates that render them)."""
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the model's chat template refused the conversation: {exc}") from None
    check_unicode(text, "the conversation")
    return text


def encode_chat(
    tokenizer, conversation: list[dict], add_generation_prompt: bool = True, **variables: Any
) -> tuple[list[int], str]:
    """(prompt token ids, prompt text) of a checked conversation; special tokens only where
    the template put them."""
    text = render_chat(tokenizer, conversation, add_generation_prompt, **variables)
    specials = special_token_texts(tokenizer)
    for i, m in enumerate(conversation):  # only the text is kept as text; other fields are refused
        for key, value in m.items():
            if key != "content" and isinstance(value, str) and any(s in value for s in specials):
                raise ValueError(
                    f"message {i}: {key!r} contains special-token text "
                    f"({next(s for s in specials if s in value)!r}); only 'content' may"
                )
    if not any(s in m["content"] for m in conversation for s in specials):
        return tokenizer.encode(text, add_special_tokens=False), text
    spans = _message_spans(tokenizer, conversation, add_generation_prompt, text, variables)
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    ids: list[int] = []
    plain_from = 0
    for start, end in _gaps(spans, len(text)):  # template text: its special tokens are real
        for match in pattern.finditer(text, start, end):
            ids += tokenizer.encode(text[plain_from : match.start()], split_special_tokens=True)
            ids.append(tokenizer.token_to_id(match.group()))
            plain_from = match.end()
    ids += tokenizer.encode(text[plain_from:], split_special_tokens=True)
    return ids, text


def special_token_texts(tokenizer) -> list[str]:
    return [t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special and t.content]


def _message_spans(
    tokenizer, conversation: list[dict], add_generation_prompt: bool, text: str, variables: dict | None = None
) -> list[tuple[int, int]]:
    """[start, end) of each message's text inside ``text``."""
    seen = set(text).union(*(m["content"] for m in conversation))
    free = (chr(c) for c in _PRIVATE_USE if chr(c) not in seen)
    opening, closing = next(free), next(free)
    marked = []
    for m in conversation:
        core = m["content"].strip()
        if core:
            lead = m["content"][: len(m["content"]) - len(m["content"].lstrip())]
            trail = m["content"][len(lead) + len(core) :]
            m = {**m, "content": f"{lead}{opening}{core}{closing}{trail}"}
        marked.append(m)
    rendered = render_chat(tokenizer, marked, add_generation_prompt, **(variables or {}))
    if rendered.replace(opening, "").replace(closing, "") != text:
        raise ValueError(
            "this model's chat template rewrites message text, so the special-token text in a message cannot be kept "
            "as plain text; remove it from the message"
        )
    spans, shift, start = [], 0, None
    for pos, ch in enumerate(rendered):
        if ch == opening:
            start = pos - shift
            shift += 1
        elif ch == closing:
            spans.append((start, pos - shift))
            shift += 1
    return spans


def _gaps(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    gaps, at = [], 0
    for start, end in sorted(spans):
        gaps.append((at, start))
        at = max(at, end)
    gaps.append((at, length))
    return gaps


def _kind(value: Any) -> str:
    return type(value).__name__
