"""Speculative decoding policies: drafters propose, verification policies decide how much of
each proposal to verify this step. Registered through ``deepinfer_register_spec_policies``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

__all__ = [
    "ConfidenceScheduledVerification",
    "DraftBatch",
    "Drafter",
    "DrafterContext",
    "DrafterFactory",
    "FixedLengthVerification",
    "VerificationPolicy",
    "VerificationPolicyFactory",
    "rejection_sample",
]


@dataclass(frozen=True)
class DraftBatch:
    """The running requests a drafter proposes for, one row each (R rows).

    ``last_token_ids[r]`` is request r's newest committed token: sampled by the target, NOT yet
    in the target's KV cache; ``positions[r]`` is its position (the request's committed length
    minus one). Drafts continue the sequence at ``positions + 1, positions + 2, ...``.
    ``hidden[r]`` is the target's last decoder layer output BEFORE the final norm at position
    ``positions[r] - 1`` (the hidden state whose logits produced ``last_token_ids[r]``): [R, D],
    or [R, hc, D] hyper-connection streams for DeepSeek-V4; None when the engine was not asked
    for it (a drafter that needs it sets ``needs_hidden = True``). ``token_ids[r]`` is the
    request's whole committed history (prompt + output, ending with ``last_token_ids[r]``) as a
    host list, for model-free drafters (n-gram); None when the engine did not build it (a drafter
    that needs it sets ``needs_token_ids = True``).
    """

    last_token_ids: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64, position of last_token_ids
    hidden: torch.Tensor | None = None  # [R, D] or [R, hc, D]
    request_ids: tuple[str, ...] = ()
    token_ids: list[list[int]] | None = field(default=None, compare=False, repr=False)


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens. Optional attributes the engine reads when present:
    ``needs_hidden`` / ``needs_token_ids`` (bool, default False: fill those DraftBatch fields),
    ``release(request_id)`` (called when a request finishes or is preempted). A drafter that keeps
    per-request state (its own KV cache) truncates it to ``positions`` at every call: drafts the
    target rejected are never committed."""

    name: str

    def propose(self, batch: DraftBatch, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(draft_ids [R, num_tokens] int64, confidences [R, num_tokens] float in [0, 1])``;
        confidence k is the drafter's probability that draft k is accepted given drafts < k
        were; 0 means "no draft here" (the engine verifies no draft at or after it, whatever the
        policy). ``num_tokens`` >= 1."""
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


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard speculative acceptance rule (Leviathan et al. 2023; Chen et al. 2023).

    Draft k is accepted with probability min(1, p_k(d_k) / q_k(d_k)) while every earlier one was;
    at the first rejection a token is drawn from norm(max(0, p_k - q_k)); when all are accepted a
    bonus token is drawn from the target's next distribution. The emitted tokens are then
    distributed exactly as sampling the target alone.

    ``target_probs`` [R, k+1, V] (row k: the distribution after all k drafts), ``draft_ids`` [R, k],
    ``draft_probs`` [R, k, V] or None for deterministic drafters (q one-hot at the draft: accept
    with probability p(d), else draw from p without d). Returns ``(tokens [R, k+1], num_accepted
    [R])``: ``tokens[r, :num_accepted[r] + 1]`` are emitted (the accepted drafts, then the
    correction or bonus token); the rest is padding. Device ops only, no host synchronisation.

    The engine itself verifies deterministic drafts by comparing each draft with the token its
    seeded sampler draws at that position (engine/spec_verify.py): the same law for one-hot q,
    and it reproduces the non-speculative output token for token.
    """
    num_reqs, k = draft_ids.shape
    p = target_probs.float()
    vocab = p.shape[-1]
    rows = torch.arange(num_reqs, device=p.device)
    if draft_probs is None:
        q = torch.zeros(num_reqs, k, vocab, device=p.device).scatter_(2, draft_ids.unsqueeze(-1), 1.0)
    else:
        q = draft_probs.float()
    p_draft = p[:, :k].gather(2, draft_ids.unsqueeze(-1)).squeeze(-1)  # [R, k]
    q_draft = q.gather(2, draft_ids.unsqueeze(-1)).squeeze(-1)
    u = torch.rand(num_reqs, k, device=p.device, generator=generator)
    accept = u * q_draft < p_draft  # u < p/q without dividing by a zero q
    num_accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [R]
    # the distribution the next token is drawn from: residual at the first rejection, else p_k
    residual = (p[:, :k] - q).clamp(min=0)  # [R, k, V]
    residual = torch.cat([residual, p[:, k:]], dim=1)  # [R, k+1, V]: the bonus row is p itself
    chosen = residual[rows, num_accepted]  # [R, V]
    total = chosen.sum(-1, keepdim=True)
    # a residual that is all zero (p == q) cannot be reached: acceptance then has probability 1
    chosen = torch.where(total > 0, chosen / total.clamp(min=1e-30), p[rows, num_accepted])
    extra = torch.multinomial(chosen, 1, generator=generator).squeeze(-1)  # [R]
    tokens = torch.cat([draft_ids, torch.zeros_like(draft_ids[:, :1])], dim=1)
    tokens[rows, num_accepted] = extra
    return tokens, num_accepted


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter factory gets besides the user's ``speculative_config`` dict.

    ``model``: the loaded target (a :class:`~deepinfer_core.models.CausalLM`: its ``config``
    dict, ``embed_tokens``/``lm_head`` style modules for drafters that share them);
    ``model_path``: the target's resolved path or alias; ``device`` / ``dtype``: where and in
    what the target computes; ``tokenizer``: the target's tokenizer or None; ``draft_dtype``:
    the dtype the engine suggests for a drafter's own float weights on this device (on a CPU:
    bfloat16 where it has bf16 dot-product instructions, else float32), or None."""

    model: Any
    model_path: str = ""
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    tokenizer: Any = None
    draft_dtype: torch.dtype | None = None


#: ``factory(config, ctx) -> Drafter``: ``config`` is the whole ``speculative_config`` dict
#: (``method``, ``num_speculative_tokens``, ``model`` for ``"draft"``, ...).
DrafterFactory = Callable[[dict, DrafterContext], Drafter]
VerificationPolicyFactory = Callable[[dict], VerificationPolicy]
