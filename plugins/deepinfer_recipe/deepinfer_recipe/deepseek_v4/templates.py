"""Fixed instruction texts of the DeepSeek V4 prompt format.

These strings are pinned byte for byte by the golden vectors (``official_1``,
``response_format_system``, ``thinking_max_effort``); they are written here once so the encoder
and its tests agree on one source. They are trusted template text: the marker strings they
mention (``<think>``, ``｜DSML｜``) are tokenized as specials, as the reference encoder does.
"""

from __future__ import annotations

import json

MAX_EFFORT_INSTRUCTION = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked."
)

TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)

TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"

RESPONSE_FORMAT_HEADER = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def tool_schema_line(tool: dict) -> str:
    """One line per tool: the function object (name, description, parameters) as JSON.

    Accepts OpenAI's ``{"type": "function", "function": {...}}`` wrapper or a bare function
    object. Non-ASCII is kept (``ensure_ascii=False``), as in vector ``official_3``.
    """
    function = tool.get("function", tool) if isinstance(tool, dict) else tool
    return json.dumps(function, ensure_ascii=False)


def response_format_json(response_format: dict) -> str:
    """The request's ``response_format`` object, verbatim as JSON (vector
    ``response_format_system``)."""
    return json.dumps(response_format, ensure_ascii=False)
