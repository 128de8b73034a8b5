"""Speculative decoding policies: drafters propose, verification policies decide how much of
each proposal to verify this step. Registered through ``deepinfer_register_spec_policies``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

__all__ = [
    "ConfidenceScheduledVerification",
    "DraftBatch",
    "Drafter",
    "DrafterFactory",
    "FixedLengthVerification",
    "VerificationPolicy",
    "VerificationPolicyFactory",
]


@dataclass(frozen=True)
class DraftBatch:
    """The running requests a drafter proposes for (device tensors)."""

    last_token_ids: torch.Tensor  # [R]
    positions: torch.Tensor  # [R], position of the last token
    # [R, D] last hidden state, for MTP-style drafters ([R, hc, D] streams for DeepSeek-V4: model.hidden_streams)
    hidden: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    name: str

    def propose(self, batch: DraftBatch, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(draft_ids [R, num_tokens], confidences [R, num_tokens])``; confidence k is the
        drafter's probability that draft k is accepted given drafts < k were."""
        ...


@runtime_checkable
class VerificationPolicy(Protocol):
    name: str

    def plan(self, confidences: torch.Tensor, budget: int) -> torch.Tensor:
        """Verify lengths per request ([R] int64, each in 0..γ, sum <= budget); a device
        tensor op, no host synchronisation."""
        ...


class FixedLengthVerification:
    """Verify every draft up to the budget, requests in order (the classic scheme)."""

    name = "fixed"

    def plan(self, confidences: torch.Tensor, budget: int) -> torch.Tensor:
        num_reqs, gamma = confidences.shape
        want = torch.full((num_reqs,), gamma, dtype=torch.long, device=confidences.device)
        before = torch.cumsum(want, 0) - want
        return (budget - before).clamp(min=0, max=gamma)


class ConfidenceScheduledVerification:
    """DSpark: verify the global top-``budget`` survival probabilities a_k = c_1...c_k.

    Survivals decrease along each row, so the top-K set is a prefix of every request and the
    verify length of a request is how many of its survivals made the cut.
    """

    name = "confidence"

    def plan(self, confidences: torch.Tensor, budget: int) -> torch.Tensor:
        num_reqs, gamma = confidences.shape
        survival = torch.cumprod(confidences.float().clamp(0, 1), dim=1)  # [R, γ]
        k = min(budget, survival.numel())
        chosen = torch.zeros(survival.numel(), dtype=torch.long, device=confidences.device)
        if k > 0:
            chosen[torch.topk(survival.flatten(), k).indices] = 1
        return chosen.view(num_reqs, gamma).sum(dim=1)


DrafterFactory = Callable[[dict], Drafter]
VerificationPolicyFactory = Callable[[dict], VerificationPolicy]
