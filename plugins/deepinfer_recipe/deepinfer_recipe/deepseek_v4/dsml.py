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

from ..json_limits import loads_strict
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


def call_parameters(arguments: str) -> dict[str, Any]:
    """The parameters an assistant turn's call renders: the arguments' JSON object; any other
    text (empty, not JSON) becomes one string parameter ``arguments`` holding it, as in the
    reference. JSON that is not an object, where the reference raises, is treated the same way."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": arguments}


def encode_value(value: Any) -> tuple[str, str]:
    """(string flag, rendered value): strings raw, everything else as JSON."""
    if isinstance(value, str):
        return "true", value
    return "false", json.dumps(value, ensure_ascii=False)


def argument_json(flag: str, raw: str) -> str:
    """One parameter of the model's output as JSON text for the call's arguments.

    As in the reference, a ``string="false"`` value is kept exactly as the model wrote it (no
    re-serialization) and a ``string="true"`` value becomes a JSON string. Where the reference
    would pass on invalid JSON (``NaN``, a typo, nesting past the limit) the raw text becomes a
    JSON string instead, so the arguments always parse and never carry a non-finite number."""
    if flag != "true":
        try:
            loads_strict(raw)
            return raw
        except ValueError:
            pass
    return json.dumps(raw, ensure_ascii=False)


def arguments_text(params: dict[str, str]) -> str:
    """``{"name": VALUE, ...}`` from parameter name -> JSON text, spaced like ``json.dumps``."""
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in params.items()) + "}"


def render_tool_calls(calls: tuple[ToolCall, ...], tags: DsmlTags = V4_TAGS) -> list[Part]:
    """``\\n\\n`` and the DSML block for an assistant turn's calls, as prompt parts
    (``｜DSML｜`` a marker; names and values are untrusted text). Invokes, and parameters inside
    an invoke, are separated by one newline; an invoke without parameters keeps an empty line."""
    mark = Marker(DSML)
    parts: list[Part] = ["\n\n<", mark, f"{tags.calls}>\n"]
    for k, call in enumerate(calls):
        parts += ["\n<" if k else "<", mark, f'{tags.invoke} name="{call.name}">\n']
        for j, (key, value) in enumerate(call_parameters(call.arguments).items()):
            flag, text = encode_value(value)
            parts += [
                "\n<" if j else "<",
                mark,
                f'{tags.parameter} name="{key}" string="{flag}">{text}</',
                mark,
                f"{tags.parameter}>",
            ]
        parts += ["\n</", mark, f"{tags.invoke}>"]
    parts += ["\n</", mark, f"{tags.calls}>"]
    return parts
