"""Expert parallelism over ``torch.distributed``: all-to-all dispatch and combine of routed tokens.

The ``ep_size`` ranks of the default process group (gloo on CPU, NCCL on GPUs: the tensors'
device picks, the code is the same) each hold ``S / ep_size`` consecutive physical expert slots
of every MoE layer; a slot holds one logical expert, and a hot expert may fill several slots
(redundant replicas, placed by EPLB). One layer, on every rank::

    topk_ids [T, k] (logical)  -> a slot per choice (replica r = token index % replicas)
      -> rows sorted by destination rank          all_to_all_single  (counts, then rows + slots)
      -> the local experts on the rows received   (the torch reference's per-expert matmuls)
      -> outputs back to where they came from     all_to_all_single
      -> weighted and summed per token in the order the single-rank reference sums them

Shared experts stay in the model (local on every rank). A rank with no tokens still takes part
in every exchange (``T == 0``): that is the empty step of attention data parallelism. The
placement is a plain table (:meth:`ExpertParallelDispatcher.set_placement`): re-placement is a
new table plus moved weights, nothing else changes.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from . import LEARNED_SCORINGS, ExpertWeights, MoECapabilities, MoESpec, ParallelConfig
from .torch_ref import TorchMoEDispatcher

__all__ = ["ExpertParallelDispatcher", "default_physical_to_logical", "replica_table"]


def default_physical_to_logical(num_experts: int, num_slots: int) -> torch.Tensor:
    """The placement a deployment starts from: slot ``p`` holds expert ``p % num_experts`` (the
    first ``num_experts`` slots in order, spare slots replicate experts 0, 1, ...). [S] int64."""
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} physical slots cannot hold {num_experts} experts")
    return torch.arange(num_slots, dtype=torch.int64) % num_experts


def replica_table(physical_to_logical: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots [E, R] int64, ascending, padded with the expert's first slot; counts [E])`` of a
    ``physical_to_logical`` row [S]. Raises when an expert has no slot."""
    p2l = physical_to_logical.to(torch.int64).cpu()
    if p2l.dim() != 1 or (p2l < 0).any() or (p2l >= num_experts).any():
        raise ValueError(f"physical_to_logical must be [S] with values in [0, {num_experts}), got {p2l.tolist()}")
    counts = torch.bincount(p2l, minlength=num_experts)
    if (counts == 0).any():
        missing = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(f"experts {missing} have no physical slot in placement {p2l.tolist()}")
    width = int(counts.max())
    slots = torch.empty(num_experts, width, dtype=torch.int64)
    for e in range(num_experts):
        mine = torch.nonzero(p2l == e).flatten()
        slots[e] = mine[torch.arange(width) % mine.numel()]  # padding repeats real slots (never read)
    return slots, counts


class ExpertParallelDispatcher:
    """The builtin dispatcher for ``ParallelConfig.ep_size > 1``: routing and expert compute as
    the torch reference, the exchange over the default process group. ``experts`` passed to
    :meth:`forward` are this rank's slots only ([S / ep_size, ...])."""

    name = "torch-expert-parallel"
    capabilities = MoECapabilities(scorings=LEARNED_SCORINGS, hash_routing=True)

    def __init__(self, spec: MoESpec, parallel: ParallelConfig, group=None) -> None:
        self.spec = spec
        self.ep_size, self.rank, self.group = parallel.ep_size, parallel.rank, group
        self.num_slots = spec.num_experts + parallel.num_redundant_experts
        if self.num_slots % self.ep_size:
            raise ValueError(
                f"MoE layer {spec.layer_index}: {spec.num_experts} experts + {parallel.num_redundant_experts} "
                f"redundant slots do not split evenly over expert_parallel_size={self.ep_size}"
            )
        self.slots_per_rank = self.num_slots // self.ep_size
        self._local = TorchMoEDispatcher()
        self._local_spec = replace(spec, num_experts=self.slots_per_rank, top_k=1, routed_scaling=1.0)
        self._load: torch.Tensor | None = None  # [E] tokens per logical expert, on the device
        self.set_placement(default_physical_to_logical(spec.num_experts, self.num_slots))

    # -- placement ---------------------------------------------------------------------------
    def set_placement(self, physical_to_logical: torch.Tensor) -> None:
        """Adopt a placement ([S] logical expert per physical slot, the same on every rank); the
        caller moves the weights (``deepinfer_core.engine.parallel.replacement``)."""
        if physical_to_logical.shape != (self.num_slots,):
            raise ValueError(f"placement must have {self.num_slots} slots, got {tuple(physical_to_logical.shape)}")
        self.physical_to_logical = physical_to_logical.to(torch.int64).cpu().clone()
        self._slots, self._counts = replica_table(self.physical_to_logical, self.spec.num_experts)
        self._device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def local_logical_experts(self) -> list[int]:
        """The logical expert of each of this rank's slots, in slot order."""
        start = self.rank * self.slots_per_rank
        return self.physical_to_logical[start : start + self.slots_per_rank].tolist()

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._device_tables:
            self._device_tables[device] = (self._slots.to(device), self._counts.to(device))
        return self._device_tables[device]

    # -- the MoEDispatcher protocol -----------------------------------------------------------
    def router_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._local.router_logits(hidden, weight)

    def select_experts(self, spec: MoESpec, router_logits, correction_bias=None, *, token_ids=None, hash_table=None):
        return self._local.select_experts(
            spec, router_logits, correction_bias, token_ids=token_ids, hash_table=hash_table
        )

    def forward(self, spec: MoESpec, hidden, topk_ids, topk_weights, experts: ExpertWeights):
        T, D = hidden.shape
        k = topk_ids.shape[1] if topk_ids.dim() == 2 else spec.top_k
        flat = topk_ids.reshape(-1).to(torch.int64)  # [T*k] logical experts
        counted = torch.bincount(flat, minlength=spec.num_experts)  # stays on the device
        self._load = counted if self._load is None else self._load + counted
        slots, counts = self._tables(hidden.device)
        token_of = torch.arange(T, device=hidden.device).repeat_interleave(k)  # [T*k]
        slot = slots[flat, token_of % counts[flat]]  # a replica per token, deterministic
        dest = slot // self.slots_per_rank
        order = torch.argsort(dest, stable=True)  # rows grouped by destination rank
        send_counts = torch.bincount(dest, minlength=self.ep_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sent, got = send_counts.tolist(), recv_counts.tolist()
        rows_in = hidden.new_empty(sum(got), D)
        dist.all_to_all_single(rows_in, hidden[token_of[order]].contiguous(), got, sent, group=self.group)
        slots_in = torch.empty(sum(got), dtype=torch.int64, device=hidden.device)
        dist.all_to_all_single(slots_in, (slot[order] % self.slots_per_rank).contiguous(), got, sent, group=self.group)
        out_local = self.compute(rows_in, slots_in, experts)  # [sum(got), D], unweighted
        back = hidden.new_empty(T * k, D)
        dist.all_to_all_single(back, out_local, sent, got, group=self.group)
        per_choice = torch.empty_like(back)
        per_choice[order] = back  # [T*k, D] in (token, choice) order
        # the single-rank reference's summation order: by logical expert, stable
        by_expert = torch.argsort(flat, stable=True)
        weighted = per_choice[by_expert] * topk_weights.reshape(-1)[by_expert, None].to(hidden.dtype)
        result = torch.zeros_like(hidden)
        result.index_add_(0, by_expert // k, weighted)
        return result

    def compute(self, rows: torch.Tensor, local_slots: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Each row through the expert of its local slot (no weighting): the torch reference's
        grouped matmuls with one choice per row."""
        if rows.shape[0] == 0:
            return rows
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        out = self._local.forward(self._local_spec, rows, local_slots[:, None], ones, experts)
        self._local.expert_load()  # the local reference counts slots; this dispatcher counts experts
        return out

    def expert_load(self):
        load, self._load = self._load, None
        return load
