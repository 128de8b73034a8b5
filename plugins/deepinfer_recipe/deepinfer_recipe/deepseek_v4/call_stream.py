"""A DSML tool-call block's calls as stream pieces (name first, then arguments text) while the
model writes them.

The parser (``parser.py``) still parses each invoke whole when its ``</｜DSML｜invoke>`` arrives;
this reads the same block text as it comes and emits a prefix of that parse's arguments, so the
pieces join to exactly the non-streamed arguments (``arguments_text``, spaced like
``json.dumps``). What it can emit when:

* the name, once the head is over (the first ``<｜DSML｜parameter`` or the invoke's close: the
  name runs to the head's last ``">``, so not earlier);
* ``{"key": `` once a parameter's header is complete; a ``string="true"`` value then streams
  inside its quotes (JSON escaping is per character, so escaped pieces join to the escaped
  whole), a tail that may begin a closing marker held back; a ``string="false"`` value is
  emitted whole at its close (whether it is valid JSON, and so kept or quoted, is known only
  then);
* ``}`` at the invoke's close.

Two rules of the parse make this possible, both where DeepSeek's reference raises: a repeated
parameter name keeps its first value (with "the last wins" nothing could stream before the
invoke closed), and a parameter still open at the invoke's close ends there. A call cut short
(block closed, end of sentence, end of output) streamed what it had; the codecs close it.

Costs time linear in the text: only the new text and a held-back tail shorter than a marker
are searched, the head and a header are matched once each (a header when a ``>`` arrives).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from json.encoder import encode_basestring

from deepinfer_core.codecs import ToolCall, ToolCallDelta

from .dsml import DsmlTags, argument_json
from .tokens import DSML, EOS

#: An invoke's head: the name up to the head's last ``">`` (reference), else to the first one.
HEAD = re.compile(r'\s*name="(.*)">\s*\Z', re.DOTALL)
LOOSE_HEAD = re.compile(r'\s*name="(.*?)">', re.DOTALL)
#: A parameter header after ``<｜DSML｜parameter``.
PARAMETER = re.compile(r'\s*name="(.*?)"\s*string="(true|false)"\s*>', re.DOTALL)

OUTSIDE, HEAD_TEXT, BETWEEN, HEADER, VALUE, SKIP_PARAM, SKIP_CALL, ENDED = range(8)
#: A head or parameter header longer than this is not streamed (its call comes at its close).
LONGEST_HEADER = 4096


def head_name(head: str) -> str | None:
    match = HEAD.match(head) or LOOSE_HEAD.match(head)
    return None if match is None else match.group(1)


def _quoted(text: str) -> str:
    """``text`` JSON-escaped, without the quotes (as ``json.dumps(..., ensure_ascii=False)``
    escapes it: that calls the same ``encode_basestring``, without building an encoder)."""
    return encode_basestring(text)[1:-1]


@dataclass(frozen=True)
class Streamed:
    """A closed invoke that was streamed: its id and the arguments text emitted for it (all of
    them, or a prefix where the streamer gave up on an overlong header)."""

    id: str
    arguments: str


class CallStreamer:
    """Fed the block's text in order (``start`` at each ``<｜DSML｜tool_calls>``, then ``feed``);
    returns the pieces that became final. ``finished[n]`` is the n-th closed invoke (counted over
    the whole output, as the parser counts them) when its name was streamed."""

    def __init__(self, tags: DsmlTags) -> None:
        self.invoke_tag, self.param_tag = f"<{DSML}{tags.invoke}", f"<{DSML}{tags.parameter}"
        self.param_close, self.invoke_close, self.calls_close = (
            tags.parameter_close,
            tags.invoke_close,
            tags.calls_close,
        )
        self.finished: dict[int, Streamed] = {}
        self.closed = 0  # invokes closed so far
        self.state = ENDED
        self._held = ""  # the unread tail: it may begin a marker
        self._region: list[str] = []  # text read whole at its end (a head, a header, a JSON value)
        self._size = 0  # characters in _region
        self._id = ""
        self._sent: list[str] = []  # arguments text emitted for the open call
        self._keys: set[str] = set()
        self._flag = ""  # the open parameter's string flag

    def start(self) -> None:
        self.state, self._held, self._region, self._size = OUTSIDE, "", [], 0

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        if self.state == ENDED or not text:
            return out
        window = self._held + text
        while True:
            hit = earliest(window, self._markers())
            if hit is None:
                self._held = self._progress(window, out)
                return out
            pos, marker = hit
            before = "".join(self._region) + window[:pos] if self._region else window[:pos]
            self._region, self._size = [], 0
            window = self._on_marker(before, marker, window[pos + len(marker) :], out)
            if self.state == ENDED:
                self._held = ""
                return out

    def plain(self, text: str) -> ToolCallDelta | None:
        """The fast path of ``feed`` (most pieces of a long string value): ``text`` inside a
        string value, with no ``<`` (every marker begins with one) and nothing held, is all
        value: its piece, escaped. None where ``feed`` must look closer. Every closing marker
        the parser watches is watched here too, so then none completes in ``text`` either."""
        if self.state != VALUE or self._flag != "true" or self._held or "<" in text or not text:
            return None
        piece = encode_basestring(text)[1:-1]
        self._sent.append(piece)
        return ToolCallDelta(self._id, arguments=piece)

    def close_call(self, index: int, call: ToolCall) -> tuple[ToolCall, list[ToolCallDelta]]:
        """The parser's ``index``-th invoke parsed whole: the call with the id it streamed under
        and the pieces still owed (none, unless an overlong header stopped the streaming)."""
        streamed = self.finished.pop(index, None)
        if streamed is None or not call.arguments.startswith(streamed.arguments):
            return replace(call, id="call_" + secrets.token_hex(12)), []  # comes whole
        rest = call.arguments[len(streamed.arguments) :]
        return replace(call, id=streamed.id), [ToolCallDelta(streamed.id, arguments=rest)] if rest else []

    def cut_call(self, call: ToolCall) -> tuple[ToolCall, list[ToolCallDelta]]:
        """The open invoke, cut short by the end of the output, parsed up to its last complete
        parameter: under the id it streamed with when what was streamed leads its arguments."""
        streamed = "".join(self._sent)
        if not self._id or not call.arguments.startswith(streamed):
            return replace(call, id="call_" + secrets.token_hex(12)), []
        rest = call.arguments[len(streamed) :]
        return replace(call, id=self._id), [ToolCallDelta(self._id, arguments=rest)] if rest else []

    # -- internals ----------------------------------------------------------------------------
    def _markers(self) -> tuple[str, ...]:
        if self.state == OUTSIDE:
            return (self.invoke_tag, self.invoke_close, self.calls_close, EOS)
        if self.state in (HEAD_TEXT, BETWEEN):
            return (self.param_tag, self.invoke_close, self.calls_close, EOS)
        if self.state == SKIP_CALL:
            return (self.invoke_close, self.calls_close, EOS)
        return (self.param_close, self.invoke_close, self.calls_close, EOS)

    def _emit(self, out: list[ToolCallDelta], text: str) -> None:
        if text:
            self._sent.append(text)
            out.append(ToolCallDelta(self._id, arguments=text))

    def _progress(self, window: str, out: list[ToolCallDelta]) -> str:
        """No marker complete in ``window``: read what can be read; returns what stays held."""
        keep = len(window) - held_suffix(window, self._markers())
        if self.state == VALUE and self._flag == "true":
            self._emit(out, _quoted(window[:keep]))
        elif self.state in (HEAD_TEXT, HEADER, VALUE) and keep:
            self._region.append(window[:keep])
            self._size += keep
            if self.state == HEADER and ">" in window[:keep]:
                if self._size > LONGEST_HEADER:
                    self._give_up()
                else:
                    region = "".join(self._region)
                    match = PARAMETER.match(region)
                    if match is not None:
                        self._region, self._size = [], 0
                        return self._progress(self._open_value(match, region, out) + window[keep:], out)
                    self._region = [region]
            elif self.state == HEAD_TEXT and self._size > LONGEST_HEADER:
                self.state, self._region, self._size = SKIP_CALL, [], 0  # the call comes whole at its close
        return window[keep:]

    def _give_up(self) -> None:
        """An overlong header: the rest of this call comes with its close (the parser sends it)."""
        self.state, self._region, self._size = SKIP_CALL, [], 0

    def _open_value(self, match: re.Match, region: str, out: list[ToolCallDelta]) -> str:
        """A parameter's header is complete: its key (unless repeated: skipped), then its value."""
        name, self._flag = match.group(1), match.group(2)
        if name in self._keys:
            self.state = SKIP_PARAM
            return ""
        self._emit(
            out,
            ("{" if not self._keys else ", ")
            + json.dumps(name, ensure_ascii=False)
            + ": "
            + ('"' if self._flag == "true" else ""),
        )
        self._keys.add(name)
        self.state = VALUE
        return region[match.end() :]

    def _on_marker(self, before: str, marker: str, after: str, out: list[ToolCallDelta]) -> str:
        """``marker`` complete after ``before`` (the region's whole text); returns the text to go
        on with."""
        if marker in (self.calls_close, EOS):  # the block ends: an open invoke is dropped
            self.state = ENDED
            return ""
        state = self.state
        if state == OUTSIDE:
            if marker == self.invoke_close:
                self.closed += 1
            else:
                self.state = HEAD_TEXT
            return after
        if state == SKIP_CALL:  # the invoke's close
            if self._id:
                self.finished[self.closed] = Streamed(self._id, "".join(self._sent))
            self._id = ""
            self.closed += 1
            self.state = OUTSIDE
            return after
        if state == HEAD_TEXT:
            name = head_name(before)
            if name is None:  # no call: ignored up to its close
                self.state = SKIP_CALL
                return self._on_marker("", marker, after, out) if marker == self.invoke_close else after
            self._id, self._sent, self._keys = "call_" + secrets.token_hex(12), [], set()
            out.append(ToolCallDelta(self._id, name=name))
        elif state == HEADER:
            match = PARAMETER.match(before)
            if match is not None:  # the header was complete in the same piece as the marker
                rest = self._open_value(match, before, out)
                if self.state == VALUE:
                    self._close_value(rest, out)
        elif state == VALUE:
            self._close_value(before, out)
        self.state = BETWEEN
        if marker == self.param_tag:
            self.state, self._flag = HEADER, ""
            return after
        if marker == self.param_close:
            return after
        self._emit(out, "}" if self._keys else "{}")  # the invoke's close
        self.finished[self.closed] = Streamed(self._id, "".join(self._sent))
        self._id = ""
        self.closed += 1
        self.state = OUTSIDE
        return after

    def _close_value(self, rest: str, out: list[ToolCallDelta]) -> None:
        self._emit(out, _quoted(rest) + '"' if self._flag == "true" else argument_json(self._flag, rest))


def earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for m in markers:
        pos = text.find(m)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, m)
    return best


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    best = 0
    for marker in markers:
        pos = text.find(marker[0], max(0, len(text) - len(marker) + 1))
        while pos != -1 and len(text) - pos > best:
            if marker.startswith(text[pos:]):
                best = len(text) - pos
                break
            pos = text.find(marker[0], pos + 1)
    return best
