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

Two corrections make "never worse than no speculation" hold where drafting is not free (a
learned head on a CPU costs a third of a target step per draft) and confidences run high:

- the step's time in the rule is the target's step plus the drafting, measured here per batch
  size (wall time of the drafter's call, which ends with the host copy of its ids), so the rule
  reads ``(requests + top-K survivals) / (1 / steps_per_second(requests + K) + draft_s [K > 0])``;
- survivals are scaled by the acceptance actually observed over what they predicted (a running
  ratio over verified drafts), so an over-confident drafter is judged by its results;
- the step's cost is the engine's own: the wall time from one proposal to the next is one whole
  engine cycle (drafting, the verify forward, sampling, commit), measured per batch size for
  plain cycles (K = 0) and for speculative ones, whose excess over a plain cycle and the curve's
  extra K tokens replaces the drafting time once measured. What the start-up curve misses
  (a verify step's host work, a GPU's decode graphs replayed for plain steps, the overlap a
  speculative engine gives up) is then in the rule. Until a batch size has a plain cycle timed,
  the rule does not run: a few plain steps (:data:`EXPLORE_STEPS`) time one first, since the
  curve of bare eager forwards can overprice a plain step 2-3x (a GPU replays graphs, overlapped)
  and then every step would verify at a loss.

When the rule gives K = 0 before drafting, the drafter is not run at all (a step of plain
decoding). Every so many such steps one proposal is drafted and verified as fixed-k would, a
probe that refreshes the survivals, the drafting time and the observed acceptance; the interval
doubles while probes keep giving K = 0 (8 up to 256 steps), so a drafter that does not pay costs
a few percent, and one that starts paying (another batch size, easier text) is found again.

What a probe costs is bounded two more ways (on an H100, 64-token runs, the probes and the two
warm-up proposals were the whole of DSpark's loss to plain decoding: 0.77-0.90x while drafting on
1-3 steps of 64, each a fixed-k step of 2-7x a plain one):

- a probe, and a warm-up proposal before the rule has survivals, drafts for at most
  :data:`PROBE_REQUESTS` requests of the batch (taken in turn), except a batch-size bucket's first
  probe, which drafts for all to time a whole speculative cycle (what the rule prices K > 0 by);
  survivals from fewer requests than the batch stand for the batch (repeated over its rows);
- the next probe waits until the last one's cost (its cycle over a plain cycle) is at most
  :data:`PROBE_SHARE` of the time since it started.
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

#: DSpark's probes while K = 0 skips drafting: after this many skipped proposals, doubling to the max
PROBE_FIRST, PROBE_MAX = 8, 256
#: a probe's and a warm-up proposal's requests (a batch bucket's first probe: all of them), and the
#: most of the wall time probes may cost
PROBE_REQUESTS, PROBE_SHARE = 4, 0.02
#: plain steps run to time a plain cycle for a batch size that has none measured (two are needed
#: where plain steps run overlapped: a cycle is timed from one step's start to the next's)
EXPLORE_STEPS = 4
CALIBRATION_DECAY = 0.98  # per verified request: the observed acceptance's running ratio forgets slowly

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


def choose_budget(
    survivals: np.ndarray,
    num_reqs: int,
    budget: int,
    rate: Callable,
    draft_s: float = 0.0,
    plain_s: float | None = None,
) -> int:
    """DSpark's K in 0..budget: argmax of (num_reqs + top-K survivals summed) * rate(num_reqs + K);
    with ``draft_s`` (seconds a speculative step adds, paid when K > 0): of that gain over the
    step's time 1 / rate(num_reqs + K) + draft_s; with ``plain_s`` (a measured plain step), the
    curve only prices the extra K tokens: plain_s + 1 / rate(num_reqs + K) - 1 / rate(num_reqs)."""
    top = np.sort(np.asarray(survivals, np.float64).ravel())[::-1][:budget]
    gain = num_reqs + np.concatenate(([0.0], np.cumsum(top)))
    steps = rate(num_reqs + np.arange(len(gain)))
    if draft_s <= 0.0 and plain_s is None:
        return int(np.argmax(gain * steps))
    seconds = 1.0 / steps
    if plain_s is not None:
        seconds = seconds - seconds[0] + plain_s
    seconds = seconds + np.where(np.arange(len(gain)) > 0, max(draft_s, 0.0), 0.0)
    return int(np.argmax(gain / seconds))


def _running_mean(means: dict[int, float], bucket: int, value: float) -> None:
    """A bucket's exponential running mean (weight 0.2 on the new value; the first is taken as is)."""
    old = means.get(bucket)
    means[bucket] = value if old is None else 0.8 * old + 0.2 * value


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
        self._old_survivals: deque[np.ndarray] = deque(maxlen=2)  # DSpark: K from two proposals back, [R, γ]
        self.last_budget: int | None = None
        # DSpark's corrections (module docstring): drafting seconds per batch-size bucket, the
        # observed / predicted acceptance, and the probes while K = 0 skips drafting
        self._draft_s: dict[int, float] = {}
        self._predicted: dict[str, np.ndarray] = {}  # request -> survivals of its planned drafts
        self._pred_sum = self._got_sum = 0.0
        self._skipped = 0  # proposals skipped since the last probe
        self._probe_every = PROBE_FIRST
        self.num_skipped = 0  # proposals not drafted because K = 0
        # engine cycles (one proposal to the next), per batch-size bucket: plain ones, and the
        # excess of speculative ones over a plain cycle plus the curve's extra K tokens
        self._plain_s: dict[int, float] = {}
        self._spec_extra_s: dict[int, float] = {}
        self._explored: set[int] = set()  # buckets whose plain cycle a short plain streak went to time
        # (start, requests, K verified (-1: not a whole speculative cycle), source, a probe) running
        self._cycle: tuple[float, int, int, str, bool] | None = None
        self._probe_at, self._probe_cost = -float("inf"), 0.0  # the last probe's start and its measured cost
        self._probe_turn = 0  # where in the batch the next small probe starts
        self._full_probed: set[int] = set()  # buckets whose whole-batch probe ran
        self._exploring = False  # a plain streak timing a plain cycle runs
        self._streak: int | None = None  # requests when DSpark last skipped drafting (a plain streak)
        self.num_plain_overlapped = 0  # plain steps of a streak the engine ran overlapped
        # totals since start (vLLM's spec_decode counters)
        self.num_drafts = 0  # verify steps of a request with >= 1 draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.gamma
        self.num_steps = 0  # proposals made (engine steps with drafts planned)
        self.draft_seconds_total = 0.0  # host wall time of those proposals (drafting and planning)

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
        now = self._next_cycle(len(reqs), "serial")
        if not reqs:
            return
        R = len(reqs)
        budget = max(0, self.max_num_batched_tokens - R)
        if self.policy.name == "confidence" and self.plain_ahead(R):
            # a streak's step known ahead (serial engines: the CPU): skipped without re-running the
            # rule, whose inputs only the next probe refreshes (~0.25 ms a step, 4% of a CPU step)
            self._skip_plain(R)
            return
        dspark = self.policy.name == "confidence"
        ready = dspark and self._dspark_ready()
        probe = dspark and not ready  # DSpark's warm-up (no survivals yet) drafts as a probe does
        if ready:
            b = self._bucket(R)
            if b not in self._plain_s and b not in self._explored:
                # no plain cycle of this batch size measured yet (without one the rule prices a plain
                # step from the start-up curve of bare forwards, which a GPU's graphs and overlap beat
                # by 2-3x): a short plain streak measures one, then the rule decides. Once per bucket:
                # where the batch changes size every step no cycle is ever timed, and the rule then
                # goes by the curve as before rather than exploring again and again. Never a probe
                # (a GPU trace, H100: an exploration that a due probe replaced left the bucket with
                # no plain cycle, and the curve, 15 ms a bare forward against 1.2 ms steps, then
                # verified 48 drafts every step at 0.35x)
                self._explored.add(b)
                self._exploring = True  # the streak ends for the rule, however far the next probe is
                self._skipped = self._probe_every - EXPLORE_STEPS
                self._skip_plain(R)
                return
            else:
                self._exploring = False
                k = self._dspark_budget(R, budget)
            if k == 0:
                if self._skipped < self._probe_every or self._probe_held(now):
                    self._skip_plain(R)  # not worth drafting: a plain decoding step
                    return
                # a probe: draft and verify as fixed-k (the whole budget), to see again whether it pays
                self._skipped = 0
                self._probe_every = min(2 * self._probe_every, PROBE_MAX)
                probe = True
            else:
                budget = k
                self._skipped, self._probe_every = 0, PROBE_FIRST
        self._streak = None
        whole = True  # a whole speculative cycle: what the rule prices K > 0 by
        if probe:
            self._probe_at = now
            b = self._bucket(R)
            if R > PROBE_REQUESTS and (b in self._full_probed or not ready):
                first = self._probe_turn % R
                reqs = [reqs[(first + i) % R] for i in range(PROBE_REQUESTS)]
                self._probe_turn = first + PROBE_REQUESTS
                whole = False
            elif ready:
                self._full_probed.add(b)
        log.debug(
            "DSpark drafts for %d of %d requests (probe %s, whole %s, budget %d)", len(reqs), R, probe, whole, budget
        )
        started = time.perf_counter()
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
        self.last_budget = budget
        lengths = self.policy.plan(confidences, budget).clamp(max=caps)
        survivals = torch.cumprod(confidences, dim=1)
        # the one host copy of the proposal: ids, verify lengths, survivals (for a later K)
        ids_host = draft_ids.to("cpu", torch.long).tolist()
        len_host = lengths.to("cpu").tolist()
        surv_host = survivals.to("cpu").numpy()
        self._old_survivals.append(surv_host)
        for r, ids, n, sv in zip(reqs, ids_host, len_host, surv_host):
            r.draft_token_ids = ids[:n]
            if n:
                self._predicted[r.request_id] = sv[:n]
        # drafted and nothing verified, or a probe of part of the batch: neither kind of cycle
        self._cycle = (now, R, (int(sum(len_host)) if whole else 0) or -1, "serial", probe)
        seconds = time.perf_counter() - started
        self._note_draft_time(len(reqs), seconds)
        self.draft_seconds_total += seconds
        self.num_steps += 1

    # -- plain streaks ---------------------------------------------------------------------------
    def plain_ahead(self, num_running: int) -> bool:
        """Whether DSpark's next proposal is already known to skip drafting: it skipped the last
        one, the batch has as many requests, and the next probe is more than one step away (in
        steps, or in time: :data:`PROBE_SHARE`). The engine then runs the step overlapped, without
        proposing (``note_plain_step``)."""
        if self._streak is None or self._streak != num_running:
            return False
        return self._skipped + 1 < self._probe_every or (not self._exploring and self._probe_held(time.perf_counter()))

    def _probe_held(self, now: float) -> bool:
        """Whether the last probe's measured cost is still more than :data:`PROBE_SHARE` of the
        time since it started (the next probe waits)."""
        return now - self._probe_at < self._probe_cost / PROBE_SHARE

    def note_plain_step(self, num_running: int) -> None:
        """A step of the streak that ran without a proposal: counted as a skipped one, and timed
        as a plain cycle (overlapped: what a plain step costs this engine)."""
        self._skip_plain(num_running)
        self.num_plain_overlapped += 1
        self._next_cycle(num_running, "overlapped")

    def _skip_plain(self, num_reqs: int) -> None:
        """A proposal not drafted (K = 0): one plain step of a streak of ``num_reqs`` requests."""
        self._skipped += 1
        self.num_skipped += 1
        self.last_budget = 0
        self._streak = num_reqs

    # -- DSpark's corrections ------------------------------------------------------------------
    def _dspark_ready(self) -> bool:
        return self.rate is not None and len(self._old_survivals) >= 2

    def _dspark_budget(self, num_reqs: int, budget: int) -> int:
        """K from the survivals two proposals back, scaled by the observed acceptance, and the
        measured drafting time."""
        old = self._old_survivals[0]  # [requests drafted, γ]
        if old.shape[0] and old.shape[0] != num_reqs:  # a probe's few requests, or another batch: as this one
            old = old[np.arange(num_reqs) % old.shape[0]]
        survivals = np.clip(old.ravel() * self.calibration(), 0.0, 1.0)
        b = self._bucket(num_reqs)
        plain = self._plain_s.get(b)
        if plain is None and self._plain_s and self.rate is not None:
            # no plain cycle of this size timed (a batch changing size every step): the nearest
            # size's, scaled as the curve scales from there (the curve alone is of bare forwards)
            near = min(self._plain_s, key=lambda x: abs(x.bit_length() - b.bit_length()))
            plain = self._plain_s[near] * float(self.rate(np.array([near]))[0] / self.rate(np.array([num_reqs]))[0])
        extra = self._spec_extra_s.get(b) if b in self._plain_s else None
        draft_s = self.draft_seconds(num_reqs) if extra is None else extra
        k = min(budget, choose_budget(survivals, num_reqs, budget, self.rate, draft_s, plain))
        log.debug("DSpark rule: %d requests, K %d (plain cycle %s s, speculative excess %s s, drafting %.6f s, "
                  "survivals %.2f, calibration %.3f)", num_reqs, k, plain, extra, draft_s, survivals.sum(),
                  self.calibration())  # fmt: skip
        return k

    def _next_cycle(self, num_reqs: int, source: str) -> float:
        """Close the engine cycle running and open one for ``num_reqs`` requests, plain until a
        proposal says otherwise; returns now. ``source``: where the clock is read, "serial" (a
        proposal, at the end of a serial step) or "overlapped" (a plain streak's step, at its
        start). A cycle is timed only between two readings of the same source with the batch the
        same size: between a serial step's end and the next overlapped step's start no step runs,
        and from an overlapped step's start to the next serial step's end two steps run."""
        now = time.perf_counter()
        if self._cycle is not None and self._cycle[1] == num_reqs and self._cycle[3] == source:
            self._note_cycle(num_reqs, self._cycle[2], now - self._cycle[0])
            if self._cycle[4]:  # a probe's cost: its cycle over a plain one
                self._probe_cost = max(0.0, now - self._cycle[0] - self._plain_s.get(self._bucket(num_reqs), 0.0))
        self._cycle = (now, num_reqs, 0, source, False) if num_reqs else None
        return now

    def _note_cycle(self, num_reqs: int, k: int, seconds: float) -> None:
        """One engine cycle's wall time: a plain one (K = 0) or a speculative one's excess."""
        b = self._bucket(num_reqs)
        if k == 0:
            _running_mean(self._plain_s, b, seconds)
        elif k > 0 and b in self._plain_s and self.rate is not None:
            extra_tokens = float(np.diff(1.0 / self.rate(np.array([num_reqs, num_reqs + k], np.float64)))[0])
            _running_mean(self._spec_extra_s, b, max(0.0, seconds - self._plain_s[b] - extra_tokens))

    @staticmethod
    def _bucket(num_reqs: int) -> int:
        return 1 << max(0, num_reqs - 1).bit_length()

    def _note_draft_time(self, num_reqs: int, seconds: float) -> None:
        _running_mean(self._draft_s, self._bucket(num_reqs), seconds)

    def draft_seconds(self, num_reqs: int) -> float:
        """Measured drafting time for a batch this size (its bucket's; else the nearest measured
        bucket's, scaled up by the size ratio when this one is larger; 0 before any)."""
        if not self._draft_s:
            return 0.0
        b = self._bucket(num_reqs)
        if b in self._draft_s:
            return self._draft_s[b]
        near = min(self._draft_s, key=lambda x: abs(x.bit_length() - b.bit_length()))
        return self._draft_s[near] * (b / near if b > near else 1.0)

    def calibration(self) -> float:
        """Accepted drafts observed over those the survivals predicted (1 until measured)."""
        if self._pred_sum <= 1e-9:
            return 1.0
        return min(2.0, self._got_sum / self._pred_sum)

    def release(self, req: Request) -> None:
        req.draft_token_ids = []
        self._predicted.pop(req.request_id, None)
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
        survivals = self._predicted.pop(req.request_id, None)
        if survivals is not None:  # the accepted drafts they predicted, for those verified
            self._pred_sum = CALIBRATION_DECAY * self._pred_sum + float(survivals[:num_spec].sum())
            self._got_sum = CALIBRATION_DECAY * self._got_sum + accepted
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
            "skipped_proposals": self.num_skipped,
            "plain_steps_overlapped": self.num_plain_overlapped,
            "acceptance_calibration": round(self.calibration(), 4),
            "proposals": self.num_steps,
            "draft_seconds": round(self.draft_seconds_total, 6),
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
