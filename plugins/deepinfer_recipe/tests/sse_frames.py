"""Reading SSE frames back (test helper; a uniquely named module, see recipe_testdata)."""

from __future__ import annotations

import json


def parse_frames(frames: list[str]) -> list[tuple[str | None, object]]:
    """[(event name or None, decoded data)]; ``[DONE]`` stays a string. Each frame must be one
    complete SSE event ending in a blank line."""
    out = []
    for frame in frames:
        assert frame.endswith("\n\n") and "\n\n" not in frame[:-2], repr(frame)
        event, data = None, None
        for line in frame[:-2].split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                event = value
            elif field == "data":
                data = value if value == "[DONE]" else json.loads(value)
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        out.append((event, data))
    return out
