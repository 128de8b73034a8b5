"""A speculative drafter's proposal in CUDA graphs, one per batch-size bucket.

The learned head's chain (``models.llama.drafter``) is ~100 small kernels per drafted token; run
eagerly, the host's launches dominate a proposal (8.8-11.9 ms for 4 tokens on an H200 host
against a 1.2-2.3 ms decode step, benchmarks/spec/spec_decode.py). Its rows are independent, so
a bucket's graph over static inputs serves any smaller batch: the real rows are copied in, the
padded rows keep earlier (valid) values and their outputs are dropped. The buckets are captured
as the decode graphs are (``decode_capture.capture_buckets``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from .decode_capture import bucket_sizes, capture_buckets, smallest_bucket

log = logging.getLogger(__name__)

DraftFn = Callable[..., tuple[torch.Tensor, ...]]


class DraftGraphs:
    """``fn`` captured for every bucket up to ``example``'s rows; call it like ``fn``."""

    def __init__(self, fn: DraftFn, example: tuple[torch.Tensor, ...]) -> None:
        start = time.perf_counter()
        self.inputs = tuple(t.clone() for t in example)  # static buffers, [max_rows, ...]
        self.buckets = bucket_sizes(example[0].shape[0])
        # the decode graphs' capture (one pool, largest first, a warm-up each), with no LM head
        self.graphs, self.outputs, _ = capture_buckets(
            self.buckets, lambda n: fn(*(t[:n] for t in self.inputs)), lambda n, out: None
        )
        log.info(
            "captured the drafter's proposal in %d CUDA graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            ",".join(map(str, self.buckets)),
            time.perf_counter() - start,
        )

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        rows = inputs[0].shape[0]
        if rows == 0 or rows > self.buckets[-1]:
            return None
        bucket = smallest_bucket(self.buckets, rows)
        for buffer, value in zip(self.inputs, inputs):
            buffer[:rows].copy_(value)
        self.graphs[bucket].replay()
        return tuple(out[:rows].clone() for out in self.outputs[bucket])


def capture_draft(fn: DraftFn, example: tuple[torch.Tensor, ...]) -> DraftGraphs | None:
    """``DecodeGraphs.capture_draft``: the graphs, or None (the drafter stays eager) where the
    inputs are not on a CUDA device or the capture fails (logged)."""
    if not example or any(t.device.type != "cuda" for t in example):
        return None
    try:
        return DraftGraphs(fn, example)
    except Exception as exc:  # an op that cannot be captured: eager drafting still works
        log.warning("the drafter runs eagerly: its proposal could not be captured (%s)", exc)
        return None
