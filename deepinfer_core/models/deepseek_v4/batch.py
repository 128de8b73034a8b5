"""The host-side view of one forward's flat batch (:class:`V4Batch`) and the index plans built
from it (:class:`StepPlans`): made once per forward by the model, read by the compressors
(``compress``) and the batched plans (``prefill``), so both import it from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class V4Batch:
    """Host-side view of the flat batch, built once per forward and shared by every layer."""

    token_ranges: tuple[tuple[int, int], ...]  # rows [a, b) of each request in the flat batch
    starts: tuple[int, ...]  # position of each request's first new token
    slots: tuple[int, ...]  # state-KV slot of each request
    block_tables: torch.Tensor  # [R, max_blocks] int
    block_size: int
    prompt_lens: tuple[int, ...] = ()  # per request, 0 where unknown


class StepPlans:
    """The index plans of one forward (:mod:`.prefill`), one per layer kind: built by
    the first layer of a kind that needs it, reused by that kind's other layers (the numpy work
    and the upload are the same for all of them). Made once per forward beside its
    :class:`V4Batch`, from whose layout the plans are built, and dropped with it."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Any] = {}

    def get(self, key: tuple, build: Callable[[], Any]) -> Any:
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]
