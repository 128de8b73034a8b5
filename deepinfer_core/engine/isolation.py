"""Keeps one request's failure from reaching the others.

A step's work splits in two. The forward pass is shared by the whole batch: when it raises
(device lost, out of memory, a kernel bug) no request is to blame, and the engine fails every
request with that error instead of leaving them to hang. Sampling and output processing are per
request: a request whose row raises is finished with ``finish_reason="error"`` and the others
go on. Sampling is row-wise and seeded per (request, position), so a row sampled alone gets the
token it would have had in the batch.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .sampler import SamplingRow, invalid_token_message

MAX_MESSAGE = 500


def describe(exc: BaseException) -> str:
    """One line for an output's ``error`` field."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def sample_isolated(
    sampler: Callable[[torch.Tensor, list[SamplingRow]], list[int]],
    logits: torch.Tensor,  # [N, V]
    request_ids: Sequence[str],
    rows: list[SamplingRow],
) -> tuple[dict[str, int], dict[str, str]]:
    """(request id -> token, request id -> error). The batch is sampled at once; only when that
    raises is each row sampled alone, to find the rows at fault. The sampler may change its
    input in place (penalties), hence the copy kept for the retry."""
    vocab = logits.shape[-1]
    pristine = logits.clone()
    try:
        tokens = sampler(logits, rows)
    except Exception:
        tokens = None
    sampled: dict[str, int] = {}
    failed: dict[str, str] = {}
    for i, (request_id, row) in enumerate(zip(request_ids, rows)):
        try:
            token = tokens[i] if tokens is not None else sampler(pristine[i : i + 1].clone(), [row])[0]
            valid = 0 <= token < vocab
        except Exception as exc:
            failed[request_id] = describe(exc)
            continue
        if valid:
            sampled[request_id] = int(token)
        else:
            failed[request_id] = invalid_token_message(token, vocab)
    return sampled, failed
