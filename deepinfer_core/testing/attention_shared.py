"""What both attention suites share (``attention`` for paged kinds, ``v4_attention`` for
DeepSeek-V4's), so neither imports the other: the cache and step schedule they run, three requests
over a small block pool, chunked prefill then decode; and how they skip a kind a backend does not
claim."""

from __future__ import annotations

import pytest

from ..attention import AttentionLayerSpec, attention_capabilities, attention_unsupported

__all__ = ["BLOCK_SIZE", "NUM_BLOCKS", "SCHEDULE", "SENTINEL", "TOTAL_LEN", "skip_unclaimed"]

BLOCK_SIZE = 4
NUM_BLOCKS = 12
SENTINEL = 7.0  # initial cache value; exact randn draws never equal it
# (request, first new position, number of new tokens) per step
SCHEDULE = (
    ((0, 0, 7), (1, 0, 3), (2, 0, 9)),
    ((0, 7, 4), (1, 3, 1), (2, 9, 1)),
    ((0, 11, 1), (2, 10, 1)),
)
TOTAL_LEN = (12, 4, 11)


def skip_unclaimed(backend, spec: AttentionLayerSpec, supported_kinds) -> None:
    """Skip the running test, saying why, when ``backend`` does not claim ``spec``'s kind: by its
    declared capabilities, or, for a backend that declares none, by the suite's
    ``supported_kinds`` (empty: nothing claimed)."""
    name = getattr(backend, "name", type(backend).__name__)
    if attention_capabilities(backend) is None and not supported_kinds:
        pytest.skip(f"{name} declares no AttentionCapabilities and the suite sets no supported_kinds")
    reason = attention_unsupported(backend, spec)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
