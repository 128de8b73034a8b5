"""What both attention suites share (``attention`` for paged kinds, ``v4_attention`` for
DeepSeek-V4's), so neither imports the other: the cache and step schedule they run, three requests
over a small block pool, chunked prefill then decode."""

from __future__ import annotations

__all__ = ["BLOCK_SIZE", "NUM_BLOCKS", "SCHEDULE", "SENTINEL", "TOTAL_LEN"]

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
