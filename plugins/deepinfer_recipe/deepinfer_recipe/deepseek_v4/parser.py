"""Incremental parser for DeepSeek V4 output text: reasoning, answer, DSML tool calls.

The text it sees is what the model generates after the prompt, so in thinking mode it starts
inside ``<think>``::

    REASONING</think>CONTENT\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls><｜end▁of▁sentence｜>

States: reasoning -> content -> tool_calls -> (content) -> done. Markers are found on text, not
token ids, so a marker split across chunks must not leak out: any suffix of the buffer that could
still grow into a marker is held back, together with the newlines in front of it (newlines
directly before ``</think>`` or a DSML block are dropped, as in the golden parses). Because
every decision depends only on complete markers, the concatenated deltas are the same whether
the text arrives whole, in random chunks or one character at a time.

Stop sequences (option ``stop``) apply to answer text only, never to reasoning or tool-call
arguments: the delta on which one is found carries ``finish_reason="stop_sequence"`` and the
parser ignores everything after it (the engine stops generating).

A tool call is emitted once its ``</｜DSML｜invoke>`` has arrived, with its arguments as JSON text
(``json.dumps``, non-ASCII kept, as the golden parses show).
"""
from __future__ import annotations

import json
import re

from deepinfer_core.codecs import ParsedOutput, ToolCall

from .dsml import V4_TAGS, DsmlTags, decode_value
from .tokens import EOS, THINK_CLOSE

REASONING, CONTENT, TOOL_CALLS, DONE = "reasoning", "content", "tool_calls", "done"


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(text.find(m), m) for m in markers if m in text]
    return min(hits) if hits else None


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    longest = max(len(m) for m in markers) - 1
    for size in range(min(len(text), longest), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0


class DeepSeekV4Parser:
    """OutputParser: ``push(text)`` returns the newly final part, ``finish()`` the rest."""

    def __init__(self, *, thinking: bool = True, tags: DsmlTags = V4_TAGS, stop: tuple[str, ...] = ()) -> None:
        self.tags = tags
        self.stop = tuple(s for s in stop if s)
        self._finish: str | None = None
        self.state = REASONING if thinking else CONTENT
        self._buf = ""
        dsml_param = re.escape(tags.parameter_open_prefix) + r'(.*?)" string="(true|false)">(.*?)' + re.escape(tags.parameter_close)
        self._param_re = re.compile(dsml_param, re.DOTALL)
        self._invoke_re = re.compile(re.escape(tags.invoke_open_prefix) + r'(.*?)">', re.DOTALL)

    def push(self, text: str) -> ParsedOutput:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> ParsedOutput:
        out = self._drain(final=True)
        self.state, self._buf = DONE, ""
        return out

    # -- internals --------------------------------------------------------------------------
    def _drain(self, *, final: bool) -> ParsedOutput:
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        while self.state != DONE:
            if self.state == TOOL_CALLS:
                if not self._drain_tool_calls(calls, final):
                    break
                continue
            sink = reasoning if self.state == REASONING else content
            markers = (THINK_CLOSE, EOS) if self.state == REASONING else (self.tags.calls_open, EOS, *self.stop)
            hit = _earliest(self._buf, markers)
            if hit is None:
                if final:
                    sink.append(self._buf)
                    self._buf = ""
                    break
                safe = self._buf[: len(self._buf) - _held_suffix(self._buf, markers)].rstrip("\n")
                sink.append(safe)
                self._buf = self._buf[len(safe):]
                break
            pos, marker = hit
            before, self._buf = self._buf[:pos], self._buf[pos + len(marker):]
            dropped_newlines = marker in (THINK_CLOSE, self.tags.calls_open)
            sink.append(before.rstrip("\n") if dropped_newlines else before)
            if marker == EOS:
                self.state = DONE
            elif marker in self.stop and self.state == CONTENT:
                self.state, self._buf, self._finish = DONE, "", "stop_sequence"
            elif marker == THINK_CLOSE:
                self.state = CONTENT
            else:
                self.state = TOOL_CALLS
        finish, self._finish = self._finish, None
        return ParsedOutput(content="".join(content), reasoning="".join(reasoning), tool_calls=tuple(calls), finish_reason=finish)

    def _drain_tool_calls(self, calls: list[ToolCall], final: bool) -> bool:
        """Emit every complete invoke; True when the block ended (state changed)."""
        while True:
            end = _earliest(self._buf, (self.tags.calls_close, EOS))
            close = self._buf.find(self.tags.invoke_close)
            if close != -1 and (end is None or close < end[0]):
                call = self._parse_invoke(self._buf[:close])
                self._buf = self._buf[close + len(self.tags.invoke_close):]
                if call is not None:
                    calls.append(call)
                continue
            if end is not None:
                pos, marker = end
                self._buf = self._buf[pos + len(marker):]
                self.state = DONE if marker == EOS else CONTENT
                return True
            if final:  # an unterminated call is dropped: its arguments may be incomplete
                self.state, self._buf = DONE, ""
                return True
            return False

    def _parse_invoke(self, segment: str) -> ToolCall | None:
        head = self._invoke_re.search(segment)
        if head is None:
            return None
        arguments = {
            name: decode_value(flag, value) for name, flag, value in self._param_re.findall(segment, head.end())
        }
        return ToolCall(name=head.group(1), arguments=json.dumps(arguments, ensure_ascii=False))
