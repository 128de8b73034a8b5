"""DSML, DeepSeek's tool-call markup, shared by the prompt encoder and the output parser.

V4 layout (golden vectors ``official_1``, ``thinking_tool_call``)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` carries the raw text of a string argument, ``string="false"`` the JSON of any
other value. ``｜DSML｜`` is one special token; the rest of each tag is ordinary text. V4.1 spells
the tag names with a leading space (``<｜DSML｜ calls>``, `` invoke``, `` parameter``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deepinfer_core.codecs import ToolCall

from .tokens import DSML, Marker, Part


@dataclass(frozen=True)
class DsmlTags:
    """Tag names of one DSML dialect (the text after ``｜DSML｜`` in each tag)."""

    calls: str = "tool_calls"
    invoke: str = "invoke"
    parameter: str = "parameter"

    @property
    def calls_open(self) -> str:
        return f"<{DSML}{self.calls}>"

    @property
    def calls_close(self) -> str:
        return f"</{DSML}{self.calls}>"

    @property
    def invoke_open_prefix(self) -> str:
        return f'<{DSML}{self.invoke} name="'

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.invoke}>"

    @property
    def parameter_open_prefix(self) -> str:
        return f'<{DSML}{self.parameter} name="'

    @property
    def parameter_close(self) -> str:
        return f"</{DSML}{self.parameter}>"


V4_TAGS = DsmlTags()
V4_1_TAGS = DsmlTags(calls=" calls", invoke=" invoke", parameter=" parameter")


def parse_arguments(arguments: str) -> dict[str, Any]:
    """Tool-call arguments (JSON object text) -> dict; an empty string means no arguments."""
    if not arguments.strip():
        return {}
    value = json.loads(arguments)
    if not isinstance(value, dict):
        raise ValueError(f"tool-call arguments must be a JSON object, got {type(value).__name__}")
    return value


def encode_value(value: Any) -> tuple[str, str]:
    """(string flag, rendered value): strings raw, everything else as JSON."""
    if isinstance(value, str):
        return "true", value
    return "false", json.dumps(value, ensure_ascii=False)


def decode_value(flag: str, raw: str) -> Any:
    """Inverse of :func:`encode_value`; JSON that does not parse is kept as the raw string
    (a model slip should not lose the argument)."""
    if flag == "true":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def render_tool_calls(calls: tuple[ToolCall, ...], tags: DsmlTags = V4_TAGS) -> list[Part]:
    """The DSML block for an assistant turn's calls, as prompt parts (``｜DSML｜`` a marker;
    names and values are untrusted text)."""
    mark = Marker(DSML)
    parts: list[Part] = ["<", mark, f"{tags.calls}>\n"]
    for call in calls:
        parts += ["<", mark, f'{tags.invoke} name="{call.name}">\n']
        for key, value in parse_arguments(call.arguments).items():
            flag, text = encode_value(value)
            parts += ["<", mark, f'{tags.parameter} name="{key}" string="{flag}">{text}</', mark, f"{tags.parameter}>\n"]
        parts += ["</", mark, f"{tags.invoke}>\n"]
    parts += ["</", mark, f"{tags.calls}>"]
    return parts
