"""Incremental parser for DeepSeek V4 output text: reasoning, answer, DSML tool calls.

The text it sees is what the model generates after the prompt, so in thinking mode it starts
inside ``<think>``::

    REASONING</think>CONTENT\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls><｜end▁of▁sentence｜>

States: reasoning -> content -> tool_calls -> (content) -> done. What it returns equals DeepSeek's
reference parser (``parse_message_from_completion_text``) on every text the reference accepts:
reasoning is everything before ``</think>`` (newlines included); up to two newlines right before
a tool-call block are dropped; ``\\s*`` may precede ``name=``; ``string="false"`` values are
kept as the model wrote them. Where the reference raises we go on: text with no end of sentence
(a length stop), a block with fewer newlines before it, text after the block (more content), a
block cut short (complete invokes are kept, and an unfinished one with its complete parameters,
as the reference does), a repeated parameter
(the first value wins), a parameter still open at its invoke's close (it ends there; both rules
let arguments stream, see ``call_stream.py``), a non-JSON value (kept as a string).

Markers are found on text, not token ids, so a marker split across chunks must not leak out:
any suffix of the buffer that could still grow into a marker is held back (in content, with up to
two newlines before it). Every decision depends only on complete markers, so the concatenated
deltas are the same however the text is chunked. Inside a tool-call block, text is only joined
and searched when a chunk completes a closing marker, so a long argument streamed in small
pieces costs time linear in its length.

Stop sequences (option ``stop``) apply to answer text only, never to reasoning or tool-call
arguments: the delta on which one is found carries ``finish_reason="stop_sequence"`` and the
parser ignores everything after it (the engine stops generating).

A tool call is emitted once its ``</｜DSML｜invoke>`` has arrived. With ``stream_calls`` (what
``make_parser`` gives the server) it is also streamed while written: its name, then pieces of its
arguments that join to the call's arguments, under the call's id (every piece is read: no quiet
state, no C front).
"""

from __future__ import annotations

from typing import Callable

from deepinfer_core.codecs import ParsedOutput, ToolCall, ToolCallDelta

from .call_stream import HEAD as _HEAD
from .call_stream import LOOSE_HEAD as _LOOSE_HEAD
from .call_stream import PARAMETER as _PARAMETER
from .call_stream import CallStreamer
from .call_stream import earliest as _earliest
from .call_stream import held_suffix as _held_suffix
from .dsml import V4_TAGS, DsmlTags, argument_json, arguments_text
from .tokens import DSML, EOS, THINK_CLOSE

REASONING, CONTENT, TOOL_CALLS, DONE = "reasoning", "content", "tool_calls", "done"
#: Returned by a push that completes nothing (immutable, so one instance serves every parser).
NOTHING = ParsedOutput()
#: Newlines dropped right before a tool-call block (the reference drops exactly "\\n\\n").
BLOCK_NEWLINES = 2


def _drop_newlines(text: str, *, keep: bool) -> str:
    """``text`` without up to two trailing newlines (``keep``: while they may still precede a
    block, i.e. they are held back, not dropped)."""
    cut = len(text)
    while cut > 0 and len(text) - cut < BLOCK_NEWLINES and text[cut - 1] == "\n":
        cut -= 1
    return text[:cut]


class DeepSeekV4Parser:
    """OutputParser: ``push(text)`` returns the newly final part, ``finish()`` the rest.

    :func:`.front.new_parser` (what ``make_parser`` uses) puts the C front of ``native`` before it where
    that was built; used alone, quiet pieces take a pure-Python closure. Same results."""

    def __init__(
        self, *, thinking: bool = True, tags: DsmlTags = V4_TAGS, stop: tuple[str, ...] = (), stream_calls: bool = False
    ) -> None:
        self.tags = tags
        self._streamer = CallStreamer(tags) if stream_calls else None
        self._deltas: list[ToolCallDelta] = []  # streamed pieces not yet returned
        self._invokes = 0  # invokes closed so far (the streamer counts them the same way)
        self.stop = tuple(s for s in stop if s)
        self._finish: str | None = None
        self._stop_hit: str | None = None  # the stop sequence that ended the answer
        self.state = REASONING if thinking else CONTENT
        self._buf = ""
        # tool-call state: pieces not yet joined, and how many characters arrived since the last
        # full-width bar (every closing marker contains one, so none can be in progress once
        # that count reaches the longest marker)
        self._pieces: list[str] = []
        self._append = self._pieces.append  # the one list, cleared and refilled, never replaced
        self._since_bar = 0
        self._front = None  # the C front that stores quiet pieces, when new_parser set one
        self._quiet_push = self._make_quiet_push()
        self._shadowed = False  # whether the quiet closure shadows the class's push
        self._block_markers = (tags.invoke_close, tags.calls_close, EOS)
        # every closing marker contains the full-width bar, so a window without one completes none
        self._window = max(len(m) for m in self._block_markers) - 1
        self._param_tag = f"<{DSML}{tags.parameter}"
        self._invoke_tag = f"<{DSML}{tags.invoke}"

    def _push(self, text: str) -> ParsedOutput:
        """``push`` in general: every piece outside the quiet state, and the one that ends it."""
        if self._front is not None and self._front._q_on:  # the front hands over a piece it does not store
            self._leave_quiet()
        if self.state is TOOL_CALLS:
            if self._streamer is not None:
                if (piece := self._streamer.plain(text)) is not None:
                    self._append(text)
                    return ParsedOutput(tool_call_deltas=(piece,))
                self._deltas += self._streamer.feed(text)
                if not self._completes_marker(text):
                    self._append(text)
                    deltas, self._deltas = tuple(self._deltas), []
                    return ParsedOutput(tool_call_deltas=deltas) if deltas else NOTHING
                self._join(text)
                return self._drain(final=False)
            bar = text.rfind("｜")
            self._since_bar = len(text) - bar - 1 if bar != -1 else self._since_bar + len(text)
            if not self._completes_marker(text):
                self._append(text)
                if self._since_bar >= self._window:  # no marker can be in progress: quiet state
                    if self._front is not None:
                        self._front._q_on = True  # the front stores the next pieces itself
                    else:
                        self.push, self._shadowed = self._quiet_push, True  # until a bar arrives
                return NOTHING
        self._join(text)
        return self._drain(final=False)

    push = _push

    def finish(self) -> ParsedOutput:
        if self._front is not None and self._front._q_on:
            self._leave_quiet()
        self._join("")
        out = self._drain(final=True)
        self.state, self._buf = DONE, ""
        return out

    # -- internals --------------------------------------------------------------------------
    def _leave_quiet(self) -> None:
        """The text the front stored becomes one piece among the others."""
        self._front._q_on = False
        text = self._front._take()
        if text:
            self._append(text)

    def _make_quiet_push(self) -> Callable[[str], ParsedOutput]:
        """The pure-Python quiet push: while an argument streams in and no closing marker can be
        in progress, only test for the bar and store the piece (no attribute lookups). A piece
        with a bar removes this shadowing instance attribute and takes the general path."""

        def quiet_push(text: str, append=self._append, bar="｜", nothing=NOTHING) -> ParsedOutput:
            # defaults, not globals or closure cells: the fastest lookups CPython has
            if bar in text:
                del self.push
                self._shadowed = False
                return self._push(text)
            append(text)
            return nothing

        return quiet_push

    def _completes_marker(self, text: str) -> bool:
        """Whether a closing marker ends inside ``text`` (looks at most one marker back)."""
        recent, need = [text], self._window
        for piece in reversed(self._pieces):
            if need <= 0:
                break
            recent.append(piece[-need:])  # a piece may be a whole flushed argument: only its tail
            need -= len(piece)
        window = "".join(reversed(recent))
        return any(m in window for m in self._block_markers)

    def _join(self, text: str) -> None:
        if self._pieces:  # then the buffer was parked among them (empty): one join, no re-copy
            self._append(text)
            self._buf += "".join(self._pieces)
            self._pieces.clear()
        else:
            self._buf += text

    def _park(self) -> None:
        """After draining: still inside a block, keep the buffer as one piece."""
        if self._shadowed:  # (a flag, not self.__dict__: touching that would cost every push a
            del self.push  # dictionary lookup, as CPython stops specializing the method lookup)
            self._shadowed = False
        self._since_bar = 0
        if self.state == TOOL_CALLS and self._buf:
            self._append(self._buf)
            self._buf = ""

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
                safe = self._buf[: len(self._buf) - _held_suffix(self._buf, markers)]
                if self.state == CONTENT:
                    safe = _drop_newlines(safe, keep=True)
                sink.append(safe)
                self._buf = self._buf[len(safe) :]
                break
            pos, marker = hit
            before, self._buf = self._buf[:pos], self._buf[pos + len(marker) :]
            sink.append(_drop_newlines(before, keep=False) if marker == self.tags.calls_open else before)
            if marker == EOS:
                self.state = DONE
            elif marker in self.stop and self.state == CONTENT:
                self.state, self._buf, self._finish, self._stop_hit = DONE, "", "stop_sequence", marker
            elif marker == THINK_CLOSE:
                self.state = CONTENT
            else:
                self.state = TOOL_CALLS
                if self._streamer is not None:
                    self._streamer.start()
                    self._deltas += self._streamer.feed(self._buf)
        self._park()
        finish, self._finish = self._finish, None
        hit, self._stop_hit = self._stop_hit, None
        deltas, self._deltas = tuple(self._deltas), []
        return ParsedOutput(
            content="".join(content),
            reasoning="".join(reasoning),
            tool_calls=tuple(calls),
            finish_reason=finish,
            stop_sequence=hit,
            tool_call_deltas=deltas,
        )

    def _drain_tool_calls(self, calls: list[ToolCall], final: bool) -> bool:
        """Emit every complete invoke; True when the block ended (state changed)."""
        while True:
            end = _earliest(self._buf, (self.tags.calls_close, EOS))
            close = self._buf.find(self.tags.invoke_close)
            if close != -1 and (end is None or close < end[0]):
                call = self._parse_invoke(self._buf[:close])
                self._invokes += 1
                self._buf = self._buf[close + len(self.tags.invoke_close) :]
                if call is not None:
                    calls.append(call)
                continue
            if end is not None:
                pos, marker = end
                self._buf = self._buf[pos + len(marker) :]
                self.state = DONE if marker == EOS else CONTENT
                return True
            if final:  # cut short: as the reference, the open invoke with its complete parameters
                last = self._buf.rfind(close_param := self.tags.parameter_close)
                call = self._parse_invoke(self._buf[: last + len(close_param)], cut=True) if last != -1 else None
                calls += [call] if call is not None else []
                self.state, self._buf = DONE, ""
                return True
            return False

    def _parse_invoke(self, segment: str, *, cut: bool = False) -> ToolCall | None:
        """One ``<invoke ...>...`` segment (its closing marker already cut off) as a call.

        As in the reference, the head (up to the first parameter) names the call up to its last
        ``">``, and a parameter's header is read only within its own text (up to its closing
        marker), so names may hold quotes or newlines; ours also tolerates whitespace the
        reference rejects. A parameter without a readable header is skipped."""
        start = segment.find(self._invoke_tag)
        if start == -1:
            return None
        start += len(self._invoke_tag)
        pos = segment.find(self._param_tag, start)
        if pos == -1:
            pos = len(segment)
        head = _HEAD.match(segment, start, pos) or _LOOSE_HEAD.match(segment, start, pos)
        if head is None:
            return None
        params: dict[str, str] = {}
        close = self.tags.parameter_close
        while (start := segment.find(self._param_tag, pos)) != -1:
            start += len(self._param_tag)
            end = segment.find(close, start)
            if end == -1:  # still open at the invoke's close: it ends there
                end = len(segment)
            match = _PARAMETER.match(segment, start, end)
            if match is not None and match.group(1) not in params:  # a repeated name keeps its first value
                params[match.group(1)] = argument_json(match.group(2), segment[match.end() : end])
            pos = end + len(close)
        call = ToolCall(name=head.group(1), arguments=arguments_text(params))
        if self._streamer is None:
            return call
        call, rest = self._streamer.cut_call(call) if cut else self._streamer.close_call(self._invokes, call)
        self._deltas += rest
        return call
