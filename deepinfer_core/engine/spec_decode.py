"""Speculative decoding in the engine loop: draft, plan, and the verify rows' sampling.

One design for every drafter (``deepinfer_register_spec_policies``)::

    step N commits tokens ──> propose(): the drafter drafts γ tokens for each decode-ready request
                               (γ per request may be 0), the verification policy plans how many of
                               each to verify (fixed: all; confidence: DSpark's global top-K)
    step N+1: the scheduler puts [last token, drafts...] in the batch (one target forward over the
              paged cache), every verified position is sampled as without drafts (seeded by
              request and position), drafts are accepted while they equal those tokens
              (model_runner._verified), the scheduler commits the accepted drafts + one more
              token and counts only their KV as computed: the rejected rows' KV is overwritten
              later (block tables keep their blocks; DeepSeek-V4's rings have γ extra rows).

Because acceptance compares each draft with the very token decoding without drafts would have
sampled at that position, the output is the same token for token (greedy and seeded sampling),
and for a deterministic draft this is the standard rule: accepted with probability p(draft), else
a token from p without it (speculative.rejection_sample states the general rule).

DSpark (``verification="confidence"``): K, the step's verification budget, maximises
``(requests + sum of the top-K survivals) x steps_per_second(requests + K)`` over a measured
steps-per-second curve of this engine, using survivals from two proposals back (already on the
host: no step waits for the device to choose K); which drafts are verified uses the current
confidences, on the device (``ConfidenceScheduledVerification.plan``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np
import torch

from ..speculative import DraftBatch, DrafterContext
from .request import Request
from .sampler import SamplingRow, sampling_row
from .spec_config import SpecConfig

log = logging.getLogger(__name__)

__all__ = ["SpecDecoder", "StepRate", "build_spec_decoder", "choose_budget"]

#: batch sizes (tokens) the start-up measurement times
CURVE_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_CURVES: dict[tuple, tuple[tuple[int, float], ...]] = {}  # measured once per process and engine kind


class StepRate:
    """Steps per second of the target at a number of batch tokens (piecewise-linear in step
    time between measured points, linear past the last one)."""

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        pts = sorted(points)
        self.tokens = np.array([t for t, _ in pts], np.float64)
        self.seconds = np.array([1.0 / s for _, s in pts], np.float64)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(tokens, np.float64)
        sec = np.interp(t, self.tokens, self.seconds)
        if len(self.tokens) >= 2:  # past the last point: the last segment's slope
            slope = max(0.0, (self.seconds[-1] - self.seconds[-2]) / (self.tokens[-1] - self.tokens[-2]))
            sec = np.where(t > self.tokens[-1], self.seconds[-1] + slope * (t - self.tokens[-1]), sec)
        return 1.0 / sec


def choose_budget(survivals: np.ndarray, num_reqs: int, budget: int, rate: Callable) -> int:
    """DSpark's K in 0..budget: argmax of (num_reqs + top-K survivals summed) * rate(num_reqs + K)."""
    top = np.sort(np.asarray(survivals, np.float64).ravel())[::-1][:budget]
    gain = num_reqs + np.concatenate(([0.0], np.cumsum(top)))
    value = gain * rate(num_reqs + np.arange(len(gain)))
    return int(np.argmax(value))


def measure_curve(run_forward: Callable[[int], None], max_tokens: int) -> tuple[tuple[int, float], ...]:
    """Time one forward of the target at each of :data:`CURVE_POINTS` (up to ``max_tokens``):
    the best of two runs after a warm-up."""
    points = []
    for n in [t for t in CURVE_POINTS if t <= max_tokens] or [1]:
        run_forward(n)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            run_forward(n)
            best = min(best, time.perf_counter() - t0)
        points.append((n, 1.0 / max(best, 1e-9)))
    return tuple(points)


class SpecDecoder:
    def __init__(self, config: SpecConfig, drafter, policy, *, device, max_num_batched_tokens: int,
                 max_model_len: int, rate: StepRate | None = None) -> None:  # fmt: skip
        self.config = config
        self.gamma = config.num_speculative_tokens
        self.drafter = drafter
        self.policy = policy
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.rate = rate
        self.needs_hidden = bool(getattr(drafter, "needs_hidden", False))
        self.needs_token_ids = bool(getattr(drafter, "needs_token_ids", False))
        self._old_survivals: deque[np.ndarray] = deque(maxlen=2)  # DSpark: K from two proposals back
        self.last_budget: int | None = None
        # totals since start (vLLM's spec_decode counters)
        self.num_drafts = 0  # verify steps of a request with >= 1 draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.gamma
        self.num_steps = 0  # proposals made (engine steps with drafts planned)

    # -- drafting ------------------------------------------------------------------------------
    def _cap(self, req: Request) -> int:
        """Drafts worth verifying: room left in max_tokens and in the context."""
        room_out = req.max_tokens - len(req.output_token_ids) - 1
        room_ctx = self.max_model_len - req.num_tokens
        return max(0, min(self.gamma, room_out, room_ctx))

    def propose(self, running: Sequence[Request], hidden: torch.Tensor | None, hidden_row: dict[str, int]) -> None:
        """Draft for every decode-ready request (its last known token not yet computed)."""
        reqs = [
            r
            for r in running
            if not r.finished
            and r.num_computed_tokens == r.num_tokens - 1
            and (not self.needs_hidden or r.request_id in hidden_row)
            and self._cap(r) > 0
        ]
        for r in running:
            r.draft_token_ids = []
        if not reqs:
            return
        R = len(reqs)
        last = torch.tensor([r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1] for r in reqs])
        positions = torch.tensor([r.num_tokens - 1 for r in reqs])
        rows = None
        if self.needs_hidden and hidden is not None:
            rows = hidden[torch.tensor([hidden_row[r.request_id] for r in reqs], device=hidden.device)]
        batch = DraftBatch(
            last_token_ids=last.to(self.device),
            positions=positions.to(self.device),
            hidden=rows,
            request_ids=tuple(r.request_id for r in reqs),
            token_ids=[r.all_token_ids for r in reqs] if self.needs_token_ids else None,
        )
        draft_ids, confidences = self.drafter.propose(batch, self.gamma)
        caps = torch.tensor([self._cap(r) for r in reqs], device=confidences.device)
        within = torch.arange(self.gamma, device=confidences.device)[None, :] < caps[:, None]
        confidences = torch.where(within, confidences.float().clamp(0, 1), torch.zeros((), device=confidences.device))
        # a confidence of 0 marks "no draft here" (n-gram without a match): never verified, by any policy
        caps = torch.minimum(caps, (torch.cumprod(confidences, dim=1) > 0).sum(dim=1))
        budget = max(0, self.max_num_batched_tokens - R)
        if self.policy.name == "confidence":
            budget = self._dspark_budget(R, budget)
        self.last_budget = budget
        lengths = self.policy.plan(confidences, budget).clamp(max=caps)
        survivals = torch.cumprod(confidences, dim=1)
        # the one host copy of the proposal: ids, verify lengths, survivals (for a later K)
        ids_host = draft_ids.to("cpu", torch.long).tolist()
        len_host = lengths.to("cpu").tolist()
        self._old_survivals.append(survivals.to("cpu").numpy().ravel())
        for r, ids, n in zip(reqs, ids_host, len_host):
            r.draft_token_ids = ids[:n]
        self.num_steps += 1

    def _dspark_budget(self, num_reqs: int, budget: int) -> int:
        if self.rate is None or len(self._old_survivals) < 2:
            return budget  # no history yet: verify as fixed-k would
        return min(budget, choose_budget(self._old_survivals[0], num_reqs, budget, self.rate))

    def release(self, req: Request) -> None:
        req.draft_token_ids = []
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(req.request_id)

    # -- verifying -----------------------------------------------------------------------------
    @staticmethod
    def verify_rows(req: Request, drafts: list[int], suppressed_for) -> tuple[SamplingRow, ...]:
        """One SamplingRow per verified position: the position's own seed and history (the
        drafts before it count as generated, for penalties and grammars)."""
        rows = []
        out = req.output_token_ids
        for j in range(len(drafts) + 1):
            hist = out + drafts[:j] if j else out
            rows.append(
                sampling_row(
                    req.params, req.seed, req.num_tokens + j, req.prompt_token_ids, hist, suppressed_for(len(hist))
                )
            )
        return tuple(rows)

    def record(self, req: Request, num_spec: int, emitted: list[int]) -> None:
        accepted = len(emitted) - 1
        self.num_drafts += 1
        self.num_draft_tokens += num_spec
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def stats(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "last_budget": self.last_budget,
        }


def build_spec_decoder(config: SpecConfig, host, ctx: DrafterContext, *, max_num_batched_tokens: int,
                       max_model_len: int, measure: Callable[[int], None] | None = None,
                       curve_key: tuple = ()) -> SpecDecoder:  # fmt: skip
    """The drafter and verification policy registered under the config's names; a name nobody
    registered is a ValueError listing those that are."""
    drafters = host.drafters()
    if config.method not in drafters:
        hint = (
            " (the learned drafter comes with `deepinfer train-drafter`'s package)" if config.method == "draft" else ""
        )
        raise ValueError(
            f"speculative_config: no drafter named {config.method!r}{hint}; installed: {', '.join(sorted(drafters))}"
        )
    policies = host.verification_policies()
    if config.verification not in policies:
        raise ValueError(
            f"speculative_config: no verification policy named {config.verification!r}; "
            f"installed: {', '.join(sorted(policies))}"
        )
    drafter = drafters[config.method](config.as_dict(), ctx)
    policy = policies[config.verification](config.as_dict())
    rate = None
    if config.verification == "confidence":
        points = config.steps_per_second
        if points is None and measure is not None:
            points = _CURVES.get(curve_key)
            if points is None:
                points = _CURVES[curve_key] = measure_curve(measure, max_num_batched_tokens)
                log.info("speculative decoding: measured steps/s at batch tokens %s", points)
        rate = StepRate(points) if points else None
    return SpecDecoder(
        config, drafter, policy, device=ctx.device, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, rate=rate,
    )  # fmt: skip
