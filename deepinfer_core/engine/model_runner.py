"""Runs one scheduled step: builds the flat batch, runs the model, samples.

The model sees only tensors: input ids and positions of every scheduled token, and an
:class:`AttentionMetadata` (cumulative query lengths, sequence lengths, block tables, slot
mapping). Nothing per request crosses into the forward as a Python list.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from ..attention import AttentionMetadata
from ..models import CausalLM
from .graphs import DecodeGraphs
from .isolation import sample_isolated
from .sampler import Sampler, SamplingRow
from .scheduler import SchedulerOutput


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, int]  # request id -> new token, for requests that reached their end
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its row could not be sampled


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], block_size: int, device: torch.device, batch_invariant: bool = False, state=None) -> None:
        self.model = model
        self.state = state  # StateKVSlots when the model keeps per-request state KV
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.batch_invariant = batch_invariant
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None  # set by the engine when the platform captures decode steps
        self.invariant_ops: Callable[[], ContextManager] | None = None  # deepinfer_batch_invariant_ops

    def build_batch(self, out: SchedulerOutput, replay: bool = False) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled requests. Returns (input_ids [T], metadata, sample row indices)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        last_token_rows: list[int] = []
        max_blocks = max(len(s.block_ids) for s in out.requests)
        tables = torch.zeros(len(out.requests), max_blocks, dtype=torch.int32)
        for r, s in enumerate(out.requests):
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            pos = range(s.start_position, s.start_position + n)
            positions.extend(pos)
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in pos)
            starts.append(starts[-1] + n)
            seq_lens.append(s.start_position + n)
            tables[r, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
            if s.sample:
                last_token_rows.append(starts[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            positions=torch.tensor(positions, dtype=torch.long).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev),
            block_tables=tables.to(dev),
            block_size=bs,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_seq_len=max(seq_lens),
            batch_invariant=self.batch_invariant,
            state_slots=None if self.state is None else torch.tensor([self.state.slot(s.request_id) for s in out.requests], dtype=torch.long).to(dev),
            replay=replay,
            prompt_lens=tuple(s.prompt_len for s in out.requests),
        )
        return torch.tensor(ids, dtype=torch.long).to(dev), meta, last_token_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, rows: dict[str, SamplingRow], replay: SchedulerOutput | None = None) -> RunnerOutput:
        if not out.requests:
            return RunnerOutput({})
        if replay is not None:  # rebuild state KV of requests resuming past a prefix hit first
            replay_ids, replay_meta, _ = self.build_batch(replay, replay=True)
            self.model.forward(replay_ids, replay_meta.positions, self.kv_caches, replay_meta)
        input_ids, meta, sample_rows = self.build_batch(out)
        with self.invariant_ops() if self.invariant_ops is not None else nullcontext():
            return self._forward_and_sample(out, rows, input_ids, meta, sample_rows)

    def _forward_and_sample(self, out: SchedulerOutput, rows: dict[str, SamplingRow], input_ids, meta, sample_rows) -> RunnerOutput:
        hidden = None
        if self.graphs is not None and meta.max_query_len == 1 and input_ids.shape[0] == meta.num_requests:
            hidden = self.graphs.run(input_ids, meta)  # a captured decode step, or None
        if hidden is None:
            hidden = self.model.forward(input_ids, meta.positions, self.kv_caches, meta)  # [T, D]
        if not sample_rows:
            return RunnerOutput({})
        logits = self.model.compute_logits(hidden[sample_rows])  # [N, V]
        sampling = [s for s in out.requests if s.sample]
        ids = [s.request_id for s in sampling]
        sampled, failed = sample_isolated(self.sampler, logits, ids, [rows[i] for i in ids])
        return RunnerOutput(sampled, failed)
