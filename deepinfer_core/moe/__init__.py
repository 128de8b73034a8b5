"""Mixture-of-experts specs, expert weights and the dispatcher protocol.

The model computes router logits; the :class:`MoEDispatcher` returned by
``deepinfer_moe_dispatcher`` selects experts (:meth:`select_experts`) and runs them
(:meth:`forward`: permute tokens by expert, grouped GEMM, un-permute and weight). Shared experts
stay in the model: they are an ordinary MLP.

Scoring rules (``MoESpec.scoring``), applied to the router logits ``z`` ([T, E], float32):

- ``softmax``: ``s = softmax(z)`` over the experts of each token.
- ``sigmoid``: ``s = 1 / (1 + exp(-z))`` (DeepSeek-V3).
- ``sqrtsoftplus``: ``s = sqrt(log(1 + exp(z)))`` (DeepSeek-V4's learned layers).
- ``hash``: the experts are not chosen from scores at all: token ``t`` goes to the fixed row
  ``hash_table[token_ids[t]]`` ([V, top_k] table shipped with the checkpoint, DeepSeek-V4's first
  ``num_hash_layers`` layers). The logits still weight those experts, scored with
  ``MoESpec.hash_scoring`` (``sqrtsoftplus`` for V4); ``correction_bias`` and groups do not apply.

Selection (every rule but ``hash``): ``c = s + correction_bias`` (the bias, when given, steers the
choice only). Group-limited routing (``num_groups > 1``) splits the E experts into ``num_groups``
equal consecutive groups; a group's score is the sum of its two best ``c`` when a correction
bias is given (DeepSeek-V3's rule) and its single best ``c`` otherwise (DeepSeek-V2's); only the
``topk_groups`` best groups stay eligible, and the ``top_k`` best eligible experts by ``c`` are
chosen. Weights are the chosen experts' ``s`` (never ``c``); with ``normalize_topk`` they are
divided by their sum (+1e-20), and then multiplied by ``routed_scaling``.

Expert compute: ``down(act(gate x) * up x)``; with ``swiglu_limit`` = L (DeepSeek-V4) the gate
pre-activation is clamped to ``<= L`` and the up pre-activation to ``[-L, L]`` before the product.

Capabilities: a dispatcher says which optional parts of the contract it implements with a
``capabilities`` attribute (:class:`MoECapabilities`). The host hands it only layers it can serve
(:func:`moe_capabilities`); one that declares nothing is taken as written for the previous
contract (contract 1): the learned scorings, no hash routing, and it is never called with
``token_ids=`` / ``hash_table=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "LEARNED_SCORINGS",
    "PREVIOUS_CONTRACT_MOE",
    "ExpertWeights",
    "MoECapabilities",
    "MoEDispatcher",
    "MoESpec",
    "ParallelConfig",
    "moe_capabilities",
]

# The scoring functions that choose experts from the router's scores (every rule but `hash`).
LEARNED_SCORINGS = frozenset({"softmax", "sigmoid", "sqrtsoftplus"})


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
    hash_scoring: str = "sqrtsoftplus"  # how a `hash` layer weights its table-chosen experts


@dataclass(frozen=True)
class ParallelConfig:
    """How the instance is split across ranks. ``ep_size == 1`` means no expert parallelism.

    With ``ep_size > 1`` the ranks of the default ``torch.distributed`` process group are the
    expert-parallel group: each MoE layer's ``num_experts + num_redundant_experts`` physical
    slots are split evenly over them (``deepinfer_core.moe.ep``)."""

    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    rank: int = 0
    num_redundant_experts: int = 0  # physical slots beyond one per expert (EPLB's replicas)


@dataclass
class ExpertWeights:
    """Routed experts' weights stacked along the expert dimension (local experts only)."""

    gate_up: torch.Tensor  # [E, 2 * I, D]: gate rows first, then up rows
    down: torch.Tensor  # [E, D, I]
    # FP8 experts (DeepSeek's block format, deepinfer_core.models.fp8): the weights above are
    # float8_e4m3fn and these are their float32 "multiply" scales, one per 128 x 128 tile:
    # [E, ceil(2I/128), ceil(D/128)] and [E, ceil(D/128), ceil(I/128)]. None: plain weights.
    # MXFP4 experts (DeepSeek-V4's routed experts kept packed, deepinfer_core.models.mxfp4): the
    # weights are uint8, two e2m1 codes a byte (low nibble first): gate_up [E, 2I, D/2], down
    # [E, D, I/2]; the scales are uint8 UE8M0 exponents b (multiply by 2^(b - 127)), one per 32
    # consecutive inputs: [E, 2I, D/32] and [E, D, I/32].
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @property
    def is_mxfp4(self) -> bool:
        """Packed MXFP4 weights (uint8) rather than FP8 tiles or plain floats."""
        return self.gate_up.dtype == torch.uint8

    def dequantized(self, dtype: torch.dtype) -> "ExpertWeights":
        """Plain ``dtype`` weights (FP8 tiles or MXFP4 groups times their scales); self when
        neither."""
        if self.gate_up_scale is None:
            return self
        from ..quant import dequant_fp4, dequant_fp8_block

        dequant = dequant_fp4 if self.is_mxfp4 else dequant_fp8_block
        return ExpertWeights(
            dequant(self.gate_up, self.gate_up_scale).to(dtype),
            dequant(self.down, self.down_scale).to(dtype),
        )


@dataclass(frozen=True)
class MoECapabilities:
    """What a :class:`MoEDispatcher` implements of the optional contract (its ``capabilities``
    attribute, usually a class attribute).

    ``scorings``: the scoring functions its ``select_experts`` computes (any of
    :data:`LEARNED_SCORINGS`). ``hash_routing``: it accepts ``token_ids=`` and ``hash_table=``
    and serves ``scoring="hash"`` layers (weighting the table's experts with
    ``spec.hash_scoring``, which must then be one of ``scorings``).
    """

    scorings: frozenset[str] = LEARNED_SCORINGS
    hash_routing: bool = False

    def unsupported(self, spec: MoESpec) -> str | None:
        """Why a dispatcher with these capabilities cannot serve ``spec``; None when it can."""
        if spec.scoring == "hash":
            if not self.hash_routing:
                return "scoring 'hash' needs hash routing (token_ids=, hash_table=), which it does not declare"
            if spec.hash_scoring not in self.scorings:
                return f"hash layers weight with {spec.hash_scoring!r}, not among its scorings {sorted(self.scorings)}"
            return None
        if spec.scoring not in self.scorings:
            return f"scoring {spec.scoring!r} is not among its scorings {sorted(self.scorings)}"
        return None


# A dispatcher that declares nothing: what the contract before capability declarations offered.
PREVIOUS_CONTRACT_MOE = MoECapabilities()


def moe_capabilities(dispatcher: object) -> MoECapabilities:
    """The dispatcher's declared :class:`MoECapabilities`, or :data:`PREVIOUS_CONTRACT_MOE` when it
    declares none. A declaration of another type is the plugin's mistake: ``TypeError``."""
    caps = getattr(dispatcher, "capabilities", None)
    if caps is None:
        return PREVIOUS_CONTRACT_MOE
    if not isinstance(caps, MoECapabilities):
        name = getattr(dispatcher, "name", dispatcher)
        raise TypeError(f"MoE dispatcher {name!r}: capabilities must be a MoECapabilities, got {caps!r}")
    return caps


@runtime_checkable
class MoEDispatcher(Protocol):
    """Expert routing and compute for MoE layers. Optional: ``capabilities`` (a
    :class:`MoECapabilities`; absent means :data:`PREVIOUS_CONTRACT_MOE`)."""

    name: str

    def select_experts(
        self,
        spec: MoESpec,
        router_logits: torch.Tensor,  # [T, E] float32
        correction_bias: torch.Tensor | None = None,  # [E], added for selection only
        *,
        token_ids: torch.Tensor | None = None,  # [T] int, required by `hash` scoring
        hash_table: torch.Tensor | None = None,  # [V, k] int, token id -> experts (`hash`)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(topk_ids [T, k] int64, topk_weights [T, k] float32)``, weights already
        normalised and multiplied by ``spec.routed_scaling`` (rules in the module docstring).

        ``token_ids`` and ``hash_table`` are keyword-only and passed only for ``hash`` layers, and
        only to a dispatcher that declares ``MoECapabilities(hash_routing=True)``; one that does
        not may leave them out of its signature. A ``hash`` layer without them is a ``ValueError``."""
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
