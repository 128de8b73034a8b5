"""Tool calls for chat-template models (those without a native prompt encoding such as V4's).

The syntax is Hermes-style, the one the ChatML family of templates (Qwen2.5, Hermes, SmolLM3)
was trained on, so a single parser serves them all::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* Prompt: a template that renders ``tools`` itself and writes ``<tool_call>`` gets the tools
  and the tool calls of earlier turns in Hugging Face's shapes (:func:`template_renders_tools`).
  Any other template (SmolLM2's renders only ``role`` and ``content``) gets
  :data:`GENERIC_TOOL_PROMPT` in its system message, earlier calls written in the same syntax
  and tool results as ``<tool_response>`` blocks in a user turn.
* Output: :class:`HermesToolParser` passes text through and turns each closed block into a
  :class:`~deepinfer_core.codecs.ToolCall`; the markup never reaches the content. While a call
  is written it streams it: a :class:`~deepinfer_core.codecs.ToolCallDelta` with the name as
  soon as ``{"name": ..., "arguments": `` has arrived, then the arguments text piece by piece
  (the arguments are kept exactly as the model wrote them, so the pieces join to the call's).
* Constraint: :func:`tool_call_tag` is an xgrammar structural tag. Under ``auto`` the text is free
  until the model writes ``<tool_call>``; from there the grammar admits only a declared tool's
  name and arguments matching its schema, then ``</tool_call>``. ``required`` must start with a
  call, a named tool choice is exactly one call. A call ends the answer unless the request sets
  ``parallel_tool_calls: true`` explicitly (then calls and text may follow): small models,
  left free after a call, tend to ramble or call again until the output limit. Arguments follow
  the tool's ``parameters``: for ``strict: true`` tools a schema xgrammar cannot compile is the
  client's error; other tools fall back to any JSON object. So every call parses, and strict
  arguments always validate.
* At most one call: ``parallel_tool_calls: false`` (OpenAI) or ``disable_parallel_tool_use``
  (Anthropic) is honoured for every model by :class:`FirstCallOnly`, a cut in the output parser:
  the first complete call ends the answer (the engine is stopped there, streamed or not), so
  formats without a grammar (DeepSeek-V4's DSML, where the model may write several invokes in
  one block) give one call too.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import replace
from typing import Any, Callable

from ..codecs import ConversationRequest, OutputParser, ParsedOutput, ProtocolError, ToolCall, ToolCallDelta
from .grammar import bounded_schema

START, END = "<tool_call>", "</tool_call>"
# the head of a call's body up to its arguments value (which must have begun: (?=\S))
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
ANY_OBJECT: dict = {"type": "object"}
_HEAD_SEARCH = 4096  # a call body this long without the usual head is not streamed

GENERIC_TOOL_PROMPT = """# Tools

You can call functions to answer. Their signatures, one JSON object per line:
<tools>
{tools}
</tools>

To call a function, write its name and arguments as a JSON object between tags, exactly so:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>
Each result comes back in a <tool_response></tool_response> block."""


def tools_active(request: ConversationRequest) -> bool:
    """Tools are offered unless none are given or ``tool_choice`` is ``none``; under ``auto`` a
    JSON ``response_format`` wins (the answer is that JSON, not a call)."""
    if not request.tools or request.tool_choice == "none":
        return False
    fmt = request.response_format
    return not (request.tool_choice in (None, "auto") and fmt and fmt.get("type") != "text")


def template_renders_tools(template: str | None) -> bool:
    """A template that reads the ``tools`` variable and writes Hermes-style calls."""
    if not template or START not in template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments or "{}")
    except ValueError:
        return call.arguments


def _call_text(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": _arguments(call)}, ensure_ascii=False)
    return f"{START}\n{body}\n{END}"


def template_messages(request: ConversationRequest, native: bool) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for a Hugging Face chat template."""
    offered = tools_active(request)
    messages: list[dict] = []
    for m in request.messages:
        role = "system" if m.role == "developer" else m.role
        if native:
            entry: dict = {"role": role, "content": m.content}
            if m.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
                    for c in m.tool_calls
                ]
            if m.tool_call_id:
                entry["tool_call_id"] = m.tool_call_id
            messages.append(entry)
        elif m.role == "tool":  # results of one turn's calls share one user turn
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if messages and messages[-1].get("tool_results"):
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\n" + block}
            else:
                messages.append({"role": "user", "content": block, "tool_results": True})
        else:
            content = "\n".join([m.content] * bool(m.content) + [_call_text(c) for c in m.tool_calls])
            messages.append({"role": role, "content": content})
    for entry in messages:
        entry.pop("tool_results", None)
    if native:
        return messages, ({"tools": [dict(t) for t in request.tools]} if offered else {})
    if offered:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in request.tools)
        note = GENERIC_TOOL_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}
        else:
            messages.insert(0, {"role": "system", "content": note})
    return messages, {}


def tool_call_tag(request: ConversationRequest, compiles: Callable[[dict], bool]) -> Any:
    """The xgrammar structural tag for this request's tool calls (see the module docstring);
    ``compiles(schema)`` says whether xgrammar can compile an argument schema."""
    from xgrammar.structural_tag import (
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    choice = request.tool_choice
    functions = [t["function"] for t in request.tools]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ProtocolError(f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    tags, seen = [], set()
    for i, function in enumerate(functions):
        name = function["name"]
        if name in seen:
            raise ProtocolError(f"tools[{i}].function.name: {name!r} is declared twice", param="tools")
        seen.add(name)
        schema = function.get("parameters") or ANY_OBJECT
        if not compiles(schema):
            if function.get("strict") is True:
                raise ProtocolError(
                    f"tools: the parameters of the strict tool {name!r} cannot be compiled into a grammar",
                    param="tools",
                )
            schema = ANY_OBJECT
        begin = f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        tags.append(
            TagFormat(
                begin=begin,
                content=JSONSchemaFormat(json_schema=bounded_schema(schema), max_whitespace_cnt=1),
                end=f"}}\n{END}",
            )
        )
    parallel = request.extra.get("parallel_tool_calls") is True
    if isinstance(choice, dict):
        return StructuralTag(format=tags[0])
    if choice == "required":
        return StructuralTag(
            format=TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True, stop_after_first=not parallel)
        )
    return StructuralTag(format=TriggeredTagsFormat(triggers=[START], tags=tags, stop_after_first=not parallel))


class HermesToolParser:
    """Incremental: text outside ``<tool_call>`` blocks is content (a tail that could begin a
    tag is held back until it cannot), each closed block one tool call. Whitespace around calls
    is dropped (text on both sides of a call is joined by one line break). A block that is not
    a JSON ``{"name", "arguments"}`` object, or one cut short by the output limit, is given
    back as the text the model wrote."""

    def __init__(self) -> None:
        self._buffer = ""  # outside a call: only a tail held back (a possible tag, whitespace)
        # Whitespace that arrives while only whitespace is held waits here, in pieces, joined
        # once something else arrives: growing one string and stripping it on every piece was
        # quadratic in a run of whitespace (inside a call's arguments too: _held_ws).
        self._ws: list[str] = []
        self._held_ws: list[str] = []
        self._in_call = False
        self._after_call = False  # drop whitespace between calls
        self._wrote = False  # some content was emitted
        # Inside a call the body arrives as pieces, joined once when the call closes: growing a
        # string and searching it again on every piece was quadratic in the call's length.
        self._parts: list[str] = []
        self._length = 0  # characters in _parts
        self._tail = ""  # the body's last len(END) - 1 characters: where END may have begun
        self._call_id = ""  # the open call's id, once its name was streamed
        self._args_at = -1  # where its arguments begin in the body (-1: not yet known)
        self._streams = False  # its arguments are an object or array (streamed)
        self._pending = ""  # arguments text not yet streamed (held back, or just arrived)
        self._sent = 0  # characters of its arguments streamed

    def push(self, text: str) -> ParsedOutput:
        content, calls, deltas = "", [], []
        while True:
            if self._in_call:
                closed = self._feed_call(text)
                if closed is None:
                    deltas += self._stream_call(text)
                    break
                body, text = closed
                self._in_call = False
                call = _parse_call(body, self._call_id or "call_" + secrets.token_hex(12))
                if call is None:
                    content += self._text(START + body + END)
                else:
                    if self._call_id and call.arguments.startswith(self._streamed(body)):
                        rest = call.arguments[self._sent :]
                        deltas += [ToolCallDelta(call.id, arguments=rest)] if rest else []
                    calls.append(call)
                    self._after_call = True
                self._reset_call()
                continue
            if text.isspace() and not _partial_tag(self._buffer):  # the buffer is whitespace too
                self._ws.append(text)
                break
            self._buffer = self._buffer + "".join(self._ws) + text
            self._ws, text = [], ""
            start = self._buffer.find(START)
            if start >= 0:
                content += self._text(self._buffer[:start].rstrip())
                text, self._buffer, self._in_call = self._buffer[start + len(START) :], "", True
                continue
            keep = _partial_tag(self._buffer)
            ready = self._buffer[: len(self._buffer) - keep]
            held = len(ready) - len(ready.rstrip())  # whitespace before a possible call waits too
            content += self._text(ready[: len(ready) - held])
            self._buffer = self._buffer[len(ready) - held :]
            break
        return ParsedOutput(content=content, tool_calls=tuple(calls), tool_call_deltas=tuple(deltas))

    def finish(self) -> ParsedOutput:
        if self._in_call:
            rest = "".join(self._parts)
            call = _parse_call(rest, self._call_id or "call_" + secrets.token_hex(12))
            streamed = self._call_id and call is not None and call.arguments.startswith(self._streamed(rest))
            sent = self._sent
            self._reset_call()
            self._in_call = False
            if streamed:
                tail = call.arguments[sent:]
                return ParsedOutput(
                    tool_calls=(call,), tool_call_deltas=(ToolCallDelta(call.id, arguments=tail),) if tail else ()
                )
            return ParsedOutput(tool_calls=(call,)) if call is not None else ParsedOutput(content=START + rest)
        rest, self._buffer, self._ws = self._buffer + "".join(self._ws), "", []
        return ParsedOutput(content=self._text(rest))

    def _feed_call(self, text: str) -> tuple[str, str] | None:
        """Add ``text`` to the open call's body; (body, text after ``</tool_call>``) once that
        closing tag has arrived. Only the last few characters and ``text`` are searched."""
        window = self._tail + text
        hit = window.find(END)
        self._parts.append(text)
        if hit < 0:
            self._length += len(text)
            self._tail = window[-(len(END) - 1) :]
            return None
        at = self._length - len(self._tail) + hit  # where END begins in the body
        joined = "".join(self._parts)
        return joined[:at], joined[at + len(END) :]

    def _reset_call(self) -> None:
        self._parts, self._length, self._tail = [], 0, ""
        self._call_id, self._args_at, self._streams, self._pending, self._sent = "", -1, False, "", 0
        self._held_ws = []

    def _streamed(self, body: str) -> str:
        return body[self._args_at : self._args_at + self._sent]

    def _stream_call(self, text: str) -> list[ToolCallDelta]:
        """Deltas of the open call (``text`` just joined its body): its name once the head is
        complete, then arguments text, holding back a tail that may still turn out to be the
        body's closing ``}`` (with the whitespace before it) or the start of ``</tool_call>``.
        Only object or array arguments are streamed (a string value would be unwrapped). Costs
        time in the new text and the held-back tail, not in the body so far."""
        out = []
        if not self._call_id:
            if self._length > _HEAD_SEARCH:  # no usual head this early: the call comes whole at its end
                return out
            body = "".join(self._parts)
            self._parts = [body]
            head = _HEAD.match(body)
            if head is None:
                return out
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return out
            self._call_id, self._args_at = "call_" + secrets.token_hex(12), head.end()
            out.append(ToolCallDelta(self._call_id, name=name))
            self._pending = body[head.end() :]
            self._streams = self._pending[:1] in ("{", "[")
        elif self._streams:
            if text.isspace() and not _partial_end(self._pending):  # nothing more can be sent yet
                self._held_ws.append(text)
                return out
            self._pending = self._pending + "".join(self._held_ws) + text
            self._held_ws = []
        if not self._streams:
            return out
        pending = self._pending
        keep = len(pending) - _partial_end(pending)
        keep = len(pending[:keep].rstrip())
        if pending[:keep].endswith("}"):
            keep = len(pending[: keep - 1].rstrip())
        if keep > 0:
            out.append(ToolCallDelta(self._call_id, arguments=pending[:keep]))
            self._sent += keep
            self._pending = pending[keep:]
        return out

    def _text(self, text: str) -> str:
        if self._after_call:  # text after a call: one line break from earlier text, if any
            text = text.lstrip()
            self._after_call = not text
            if text and self._wrote:
                text = "\n" + text
        self._wrote = self._wrote or bool(text)
        return text


def _partial_tag(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


def _partial_end(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``</tool_call>``."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-n:]):
            return n
    return 0


def _parse_call(body: str, call_id: str) -> ToolCall | None:
    """A block's call, its arguments as the model wrote them where the body has the usual
    ``{"name": ..., "arguments": ...}`` layout (else re-serialized)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    head = _HEAD.match(body)
    if head is not None and isinstance(arguments, (dict, list)):
        raw = body[head.end() :].rstrip()
        raw = raw[:-1].rstrip() if raw.endswith("}") else raw
        try:
            if json.loads(raw) == arguments:
                text = raw
        except ValueError:
            pass
    return ToolCall(name=value["name"], arguments=text, id=call_id)


def single_call(request: ConversationRequest) -> bool:
    """The request allows at most one tool call (``parallel_tool_calls`` set to false)."""
    return tools_active(request) and request.extra.get("parallel_tool_calls") is False


class FirstCallOnly:
    """Wraps an output parser: the delta that completes the first tool call ends the output
    (``finish_reason="tool_calls"``: the server stops the engine there, as for a stop sequence);
    further calls, and anything after, are dropped."""

    def __init__(self, inner: OutputParser) -> None:
        self.inner = inner
        self.done = False

    def push(self, text: str) -> ParsedOutput:
        return ParsedOutput() if self.done else self._cut(self.inner.push(text))

    def finish(self) -> ParsedOutput:
        return ParsedOutput() if self.done else self._cut(self.inner.finish())

    def _cut(self, parsed: ParsedOutput) -> ParsedOutput:
        if not parsed.tool_calls:
            return parsed
        self.done = True
        first = parsed.tool_calls[0]
        deltas = tuple(d for d in parsed.tool_call_deltas if d.id == first.id)  # a later call's start is dropped
        return replace(
            parsed, tool_calls=(first,), tool_call_deltas=deltas, finish_reason="tool_calls", stop_sequence=None
        )
