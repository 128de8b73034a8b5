"""Random paged batches for attention-kernel tests and benchmarks: requests whose KV blocks lie
scattered over a shuffled pool, and the batch layout (positions, query starts, slots) of a step
that runs the last tokens of each request.

Why shuffled: a kernel that ignores the block table, or that reads a neighbour's block, still
passes when every request's blocks are 0, 1, 2, ... in order; spare blocks in the pool make an
unused block a possible neighbour too. The only randomness is one ``randperm`` of the pool drawn
from the caller's generator, so a caller's later draws (cache contents, queries) stay where they
were.

    lens (6, 9), block_size 4: 2 + 3 blocks used; spare_blocks 2: a pool of num_blocks 7

    randperm(7)   3 6 | 0 4 1 | 5 2     (request 0's, request 1's, never addressed)
    block_tables  [[3, 6, 0],           (request 0's row padded with 0)
                   [0, 4, 1]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_core.attention import AttentionMetadata

__all__ = ["ScatteredBatch", "scattered_batch"]


@dataclass(frozen=True)
class ScatteredBatch:
    """Block tables of requests over a shuffled pool, and the step that runs the last
    ``query_lens[r]`` of each request's ``seq_lens[r]`` tokens. Tensors are on the CPU."""

    block_tables: torch.Tensor  # [R, max blocks] int32; entries past a request's blocks are 0
    block_size: int
    num_blocks: int  # the pool: the blocks the tables address plus the spare ones
    seq_lens: tuple[int, ...]  # context of each request after this step
    query_lens: tuple[int, ...]  # this step's tokens of each request (the last of its context)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_attention_pairs(self) -> int:
        """Causal (query, key) pairs of the step, summed over requests."""
        return sum(q * (n - q) + q * (q + 1) // 2 for n, q in zip(self.seq_lens, self.query_lens))

    @property
    def query_start_loc(self) -> torch.Tensor:  # [R+1] int32
        starts = [0]
        for q in self.query_lens:
            starts.append(starts[-1] + q)
        return torch.tensor(starts, dtype=torch.int32)

    @property
    def positions(self) -> torch.Tensor:  # [T] int64
        return torch.cat([torch.arange(n - q, n) for n, q in zip(self.seq_lens, self.query_lens)])

    @property
    def requests(self) -> torch.Tensor:  # [T] int64, the request of each token
        return torch.repeat_interleave(torch.arange(len(self.seq_lens)), torch.tensor(self.query_lens))

    @property
    def slot_mapping(self) -> torch.Tensor:  # [T] int64, where each token's KV entry lives
        pos = self.positions
        return self.block_tables[self.requests, pos // self.block_size].long() * self.block_size + pos % self.block_size

    def metadata(
        self, device: torch.device | str, *, slot_mapping: torch.Tensor | None = None, **fields
    ) -> AttentionMetadata:
        """The step's ``AttentionMetadata`` on ``device``. ``slot_mapping`` defaults to the
        tokens' slots (a caller whose backend never writes there may pass its own); ``fields``
        sets the optional ones (``state_slots``, ``num_context_tokens``, ...) as given."""
        slots = self.slot_mapping if slot_mapping is None else slot_mapping
        return AttentionMetadata(
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device), positions=self.positions.to(device),
            slot_mapping=slots.to(device), block_tables=self.block_tables.to(device), block_size=self.block_size,
            max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens), **fields,
        )  # fmt: skip


def scattered_batch(
    lens: Sequence[int], new: int | Sequence[int], *, block_size: int, generator: torch.Generator, spare_blocks: int = 0
) -> ScatteredBatch:
    """Requests of ``lens`` tokens of context whose last ``new`` (one count for all, or one per
    request; a request shorter than its count runs whole) are this step's tokens, their
    ``ceil(len / block_size)`` blocks each taken in order from ``randperm(blocks used +
    spare_blocks)`` drawn from ``generator``."""
    lens = [int(n) for n in lens]
    news = [int(new)] * len(lens) if isinstance(new, int) else [int(q) for q in new]
    if not lens or len(news) != len(lens):
        raise ValueError(
            f"lens and new: one entry per request, at least one request (got {len(lens)} lens, {len(news)} new)"
        )
    if min(lens) < 1 or min(news) < 1:
        raise ValueError(f"lens and new must be >= 1 (got lens {lens}, new {news})")
    if block_size < 1 or spare_blocks < 0:
        raise ValueError(f"block_size must be >= 1 and spare_blocks >= 0 (got {block_size}, {spare_blocks})")
    need = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(need) + spare_blocks, generator=generator).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return ScatteredBatch(
        tables, block_size, sum(need) + spare_blocks, tuple(lens), tuple(min(q, n) for q, n in zip(news, lens))
    )
