"""Flattening one scheduled step into the model's input tensors, vectorised.

Why this module: building the batch token by token in Python lists cost ~80 ms of host time on
a 64 x 512-token prefill and a large share of a 64-request decode step (benchmarks/README.md).
Here every per-token array is computed with numpy from a few per-request arrays, all of them are
packed into one int64 buffer and copied to the device once. On an accelerator that buffer is one
of the device's reusable pinned staging buffers (deepinfer_core/staging.py) and the copy is asynchronous,
so building step N+1 never waits for step N's kernels (a pageable copy synchronises with the
device's queue, which would undo overlapped scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from ..attention import AttentionMetadata
from ..staging import arrays_to_device
from .scheduler import SchedulerOutput

PENDING = -1  # a token id placeholder: sampled by the step in flight, still on the device


@dataclass(frozen=True)
class BatchColumns:
    """A decode step's layout (one token per request, every row sampled) as arrays, for
    :func:`build` to take instead of reading each :class:`ScheduledRequest` (overlap.Chain keeps
    them from step to step). Equal to what the records say: test_overlap_chain builds both ways."""

    starts: np.ndarray  # [R] int64, each request's position
    tables: np.ndarray  # [R, width] int64 block tables, zero-padded as build lays them out (read only)
    nblocks: np.ndarray  # [R] int64 blocks per request
    prompt_lens: tuple[int, ...]
    ids: tuple[str, ...]  # the request ids, in order


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [T] int64 on the device
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of the flat batch whose logits are sampled
    sample_index: torch.Tensor | None  # the same rows on the device; None: every row, in order


def build(
    out: SchedulerOutput,
    block_size: int,
    device: torch.device,
    *,
    batch_invariant: bool = False,
    state_slots: list[int] | None = None,
    replay: bool = False,
    input_ids: torch.Tensor | None = None,
    verify_as_decode_rows: bool = False,
) -> Batch:
    """The flat batch of ``out``. ``input_ids`` (a device tensor, one id per scheduled token)
    replaces the scheduled token ids; it must be given when any of them is :data:`PENDING`.

    ``verify_as_decode_rows``: a step whose every row is sampled and where some request verifies
    drafts (no prompt chunk in it) is laid out as a decode step of one row per token: each row
    its request's block table and ``seq_len = position + 1``. A layer writes every row's key and
    value before its attention reads any, so a row sees its request's earlier drafts as a causal
    verify forward would, through the decode kernels (and their captured graphs) with a decode
    step's numerics. Only for models whose attention reads nothing but the paged cache (no state
    KV): the caller decides."""
    reqs = out.requests
    R = len(reqs)
    bs = block_size
    columns = out.columns
    rows = np.arange(R)
    if columns is not None:  # a continuation: one token per request, every row sampled
        lens, starts, nblocks, sample, tables = (
            np.ones(R, np.int64),
            columns.starts,
            columns.nblocks,
            np.ones(R, np.bool_),
            columns.tables,
        )
        width = tables.shape[1]
    else:
        lens = np.fromiter((len(s.token_ids) for s in reqs), np.int64, R)
        starts = np.fromiter((s.start_position for s in reqs), np.int64, R)
        nblocks = np.fromiter((len(s.block_ids) for s in reqs), np.int64, R)
        sample = np.fromiter((s.sample for s in reqs), np.bool_, R)
        width = max(1, int(nblocks.max()))
        tables = np.zeros((R, width), np.int64)
        flat_blocks = np.fromiter(chain.from_iterable(s.block_ids for s in reqs), np.int64, int(nblocks.sum()))
        bcu = np.concatenate(([0], np.cumsum(nblocks)))
        tables[np.repeat(rows, nblocks), np.arange(flat_blocks.size) - np.repeat(bcu[:-1], nblocks)] = flat_blocks
    T = int(lens.sum())
    cu = np.zeros(R + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    row_of = np.repeat(rows, lens)
    positions = np.arange(T, dtype=np.int64) + np.repeat(starts - cu[:-1], lens)
    block_of = positions // bs
    if T and not (block_of < nblocks[row_of]).all():
        bad = int(row_of[np.argmax(block_of >= nblocks[row_of])])
        raise RuntimeError(
            f"request {reqs[bad].request_id!r} is scheduled past its KV blocks ({len(reqs[bad].block_ids)} blocks)"
        )
    slots = tables[row_of, block_of] * bs + positions % bs
    seq_lens = starts + lens
    spec = None if columns is not None else np.fromiter((s.num_spec for s in reqs), np.int64, R)
    if spec is not None and spec.any():  # a verify step samples the last num_spec + 1 rows of each request
        per = np.where(sample, spec + 1, 0)
        first = np.repeat(cu[1:] - per, per)
        sample_rows = first + np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
    else:
        sample_rows = cu[1:][sample] - 1
    if verify_as_decode_rows and spec is not None and spec.any() and len(sample_rows) == T and state_slots is None:
        tables, seq_lens = tables[row_of], positions + 1
        prompt_lens = tuple(np.repeat(np.fromiter((s.prompt_len for s in reqs), np.int64, R), lens).tolist())
        R, lens, cu = T, np.ones(T, np.int64), np.arange(T + 1, dtype=np.int64)
        sample_rows, sample = np.arange(T, dtype=np.int64), np.ones(T, np.bool_)
    else:
        prompt_lens = columns.prompt_lens if columns is not None else tuple(s.prompt_len for s in reqs)
    parts = [positions, slots, cu, seq_lens, tables.ravel(), sample_rows]
    if input_ids is None:
        arrays = [s.token_array for s in reqs]
        if R and all(
            a is not None for a in arrays
        ):  # prompt chunks: their ids as arrays already (no per-token conversion)
            ids = np.concatenate(arrays).astype(np.int64)
        else:
            ids = np.fromiter(chain.from_iterable(s.token_ids for s in reqs), np.int64, T)
            if (ids == PENDING).any():  # a token of the step in flight: never read before it exists
                raise RuntimeError(
                    "overlap guard: a scheduled token is still pending on the device and no device ids were given"
                )
        parts.append(ids)
    elif tuple(input_ids.shape) != (T,):
        raise ValueError(f"input_ids must have shape ({T},), got {tuple(input_ids.shape)}")
    if state_slots is not None:
        parts.append(np.asarray(state_slots, np.int64))
    dev = arrays_to_device(parts, device)
    sizes = (
        [T, T, R + 1, R, R * width, len(sample_rows)]
        + ([T] if input_ids is None else [])
        + ([R] if state_slots is not None else [])
    )
    pieces = list(torch.split(dev, sizes))
    pos_t, slot_t, cu_t, seq_t, tab_t, samp_t = pieces[:6]
    ids_t = pieces[6] if input_ids is None else input_ids
    meta = AttentionMetadata(
        query_start_loc=cu_t.to(torch.int32),
        seq_lens=seq_t.to(torch.int32),
        positions=pos_t,
        slot_mapping=slot_t,
        block_tables=tab_t.view(R, width).to(torch.int32),
        block_size=bs,
        max_query_len=int(lens.max()) if R else 0,
        max_seq_len=int(seq_lens.max()) if R else 0,
        batch_invariant=batch_invariant,
        state_slots=pieces[-1] if state_slots is not None else None,
        replay=replay,
        prompt_lens=prompt_lens,
        num_context_tokens=int(seq_lens.sum()),
        num_attention_pairs=int(positions.sum()) + T,  # query at position p sees keys 0..p
        **(_host_layout(cu, seq_lens, state_slots) if state_slots is not None else {}),
    )
    every_row = len(sample_rows) == T and bool(sample.all()) and T == R
    return Batch(ids_t, meta, sample_rows.tolist(), None if every_row else samp_t)


def _host_layout(cu: np.ndarray, seq_lens: np.ndarray, state_slots: list[int]) -> dict:
    """The layout as host tuples, for models with state KV (DeepSeek-V4 plans its compressors
    on the host; reading the device tensors back cost a sync per forward)."""
    return dict(
        host_query_start_loc=tuple(cu.tolist()),
        host_seq_lens=tuple(seq_lens.tolist()),
        host_state_slots=tuple(state_slots),
    )
