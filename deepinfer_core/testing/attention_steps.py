"""The cache and step schedule both attention suites run (``attention`` for paged kinds,
``v4_attention`` for DeepSeek-V4's): three requests over a small block pool, chunked prefill then
decode, so each suite imports them from here rather than from the other."""

from __future__ import annotations

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
