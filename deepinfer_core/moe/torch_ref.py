"""Pure-torch reference MoE: grouped routing, token permutation and per-expert matmuls."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import LEARNED_SCORINGS, ExpertWeights, MoECapabilities, MoESpec

__all__ = ["TorchMoEDispatcher"]


class TorchMoEDispatcher:
    name = "torch-reference"
    capabilities = MoECapabilities(scorings=LEARNED_SCORINGS, hash_routing=True)

    def __init__(self) -> None:
        self._load: torch.Tensor | None = None

    def router_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Optional (models call it where a dispatcher has it): float32 router logits
        ``[T, E]`` of ``hidden [T, D]`` and a float32 router weight ``[E, D]``, the products
        in float32 whatever hidden's dtype (DeepSeek-V3's router; a plugin may fuse the cast)."""
        return F.linear(hidden.float(), weight.float())

    def select_experts(self, spec: MoESpec, router_logits, correction_bias=None, *, token_ids=None, hash_table=None):
        logits = router_logits.float()
        if spec.scoring == "hash":
            topk_ids = _hash_choice(spec, logits, token_ids, hash_table)
            scores = _scores(spec.hash_scoring, logits, self.name)
        else:
            scores = _scores(spec.scoring, logits, self.name)
            choice = scores if correction_bias is None else scores + correction_bias.float()
            if spec.num_groups > 1:
                choice = _mask_to_best_groups(choice, spec, use_top2=correction_bias is not None)
            topk_ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, topk_ids)
        if spec.normalize_topk:  # top-1 normalises to 1.0, as the references do
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * spec.routed_scaling
        return topk_ids, weights

    def forward(self, spec: MoESpec, hidden, topk_ids, topk_weights, experts: ExpertWeights):
        T, D = hidden.shape
        experts = experts.dequantized(hidden.dtype)  # FP8 experts: the reference widens them all
        flat_ids = topk_ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=spec.num_experts)
        self._load = counts if self._load is None else self._load + counts
        token_of = order // spec.top_k  # which token each permuted row came from
        x = hidden[token_of]  # [T*k, D], grouped by expert
        out = torch.empty_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            rows = x[start : start + n]
            gate_up = rows @ experts.gate_up[e].t()  # [n, 2I]
            gate, up = gate_up.chunk(2, dim=-1)
            if spec.swiglu_limit is not None:
                gate = gate.clamp(max=spec.swiglu_limit)
                up = up.clamp(-spec.swiglu_limit, spec.swiglu_limit)
            out[start : start + n] = (F.silu(gate) * up) @ experts.down[e].t()
            start += n
        weighted = out * topk_weights.reshape(-1)[order, None].to(out.dtype)
        result = torch.zeros_like(hidden)
        result.index_add_(0, token_of, weighted)
        return result

    def expert_load(self):
        load, self._load = self._load, None
        return load


def _scores(scoring: str, logits: torch.Tensor, name: str) -> torch.Tensor:
    if scoring == "softmax":
        return logits.softmax(dim=-1)
    if scoring == "sigmoid":
        return logits.sigmoid()
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    raise ValueError(f"scoring {scoring!r} is not supported by {name}; allowed: softmax, sigmoid, sqrtsoftplus, hash")


def _hash_choice(spec: MoESpec, logits: torch.Tensor, token_ids, hash_table) -> torch.Tensor:
    """The fixed experts of each token: ``hash_table[token_ids]`` (checked, then int64)."""
    if token_ids is None or hash_table is None:
        missing = [n for n, v in (("token_ids", token_ids), ("hash_table", hash_table)) if v is None]
        raise ValueError(f"MoE layer {spec.layer_index}: scoring 'hash' needs {' and '.join(missing)}")
    if token_ids.reshape(-1).shape[0] != logits.shape[0]:
        raise ValueError(
            f"MoE layer {spec.layer_index}: token_ids has {token_ids.numel()} entries for {logits.shape[0]} tokens"
        )
    if hash_table.dim() != 2 or hash_table.shape[1] != spec.top_k:
        raise ValueError(
            f"MoE layer {spec.layer_index}: hash_table must be [vocab, top_k={spec.top_k}], got "
            f"{tuple(hash_table.shape)}"
        )
    return hash_table[token_ids.reshape(-1).to(hash_table.device).long()].long().to(logits.device)


def _mask_to_best_groups(choice: torch.Tensor, spec: MoESpec, use_top2: bool) -> torch.Tensor:
    T, E = choice.shape
    grouped = choice.view(T, spec.num_groups, E // spec.num_groups)
    if use_top2:  # DeepSeek-V3: a group's score is the sum of its two best experts
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = group_scores.topk(spec.topk_groups, dim=-1, sorted=False).indices  # [T, g]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    # -inf, not 0: with a negative correction bias a kept expert's choice score can be below 0,
    # and a zero would let an expert from a dropped group win the top-k.
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
