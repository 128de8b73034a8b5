"""Mixture-of-experts specs, expert weights and the dispatcher protocol.

The model computes router logits; the :class:`MoEDispatcher` returned by
``deepinfer_moe_dispatcher`` selects experts (:meth:`select_experts`) and runs them
(:meth:`forward`: permute tokens by expert, grouped GEMM, un-permute and weight). Shared experts
stay in the model: they are an ordinary MLP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class MoESpec:
    """Static description of one MoE layer."""

    layer_index: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # width of one routed expert
    scoring: str = "softmax"  # softmax | sigmoid | sqrtsoftplus | hash
    num_groups: int = 1  # group-limited routing: experts split into groups ...
    topk_groups: int = 1  # ... and only the best `topk_groups` groups may be chosen
    normalize_topk: bool = True
    routed_scaling: float = 1.0
    num_shared_experts: int = 0
    activation: str = "silu"  # gated: act(gate) * up
    swiglu_limit: float | None = None  # clamp (DeepSeek-V4)


@dataclass(frozen=True)
class ParallelConfig:
    """How the instance is split across ranks. ``ep_size == 1`` means no expert parallelism."""

    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    rank: int = 0


@dataclass
class ExpertWeights:
    """Routed experts' weights stacked along the expert dimension (local experts only)."""

    gate_up: torch.Tensor  # [E, 2 * I, D]: gate rows first, then up rows
    down: torch.Tensor  # [E, D, I]


@runtime_checkable
class MoEDispatcher(Protocol):
    name: str

    def select_experts(
        self,
        spec: MoESpec,
        router_logits: torch.Tensor,  # [T, E] float32
        correction_bias: torch.Tensor | None = None,  # [E], added for selection only
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(topk_ids [T, k] int64, topk_weights [T, k] float32)``, weights already
        normalised and multiplied by ``spec.routed_scaling``."""
        ...

    def forward(
        self,
        spec: MoESpec,
        hidden: torch.Tensor,  # [T, D]
        topk_ids: torch.Tensor,  # [T, k]
        topk_weights: torch.Tensor,  # [T, k]
        experts: ExpertWeights,
    ) -> torch.Tensor:  # [T, D]
        """Weighted sum of the chosen experts' outputs per token."""
        ...

    def expert_load(self) -> torch.Tensor | None:
        """Tokens routed to each expert since the last call ([E] int64), for EPLB; None if
        not tracked."""
        ...
