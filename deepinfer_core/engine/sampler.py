"""Token selection: penalties, temperature, top-k / top-p / min-p, seeded sampling.

Every operation is row-wise, and the random noise of a row is drawn from a generator seeded
with (request seed, position): a request's tokens never depend on what else is in the batch.
Sampling is Gumbel-max in its exponential form: argmax(p / E) with E ~ Exp(1) picks token i
with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..staging import to_device
from .sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1

#: The id a row gets when nothing may be sampled: its logits processors and suppressed tokens
#: together mask the whole vocabulary (a finished grammar allows only EOS while ``min_tokens``
#: bans it). It travels with the step's other ids in their one device-to-host copy, so the
#: engine finishes that request at once, with :data:`ALL_MASKED_MESSAGE`, without a sync.
ALL_MASKED = -1
ALL_MASKED_MESSAGE = (
    "ValueError: no token can be sampled: the request's logits processors (its grammar, "
    "response_format or tool-call constraint) and its banned tokens (min_tokens bans the stop "
    "tokens until it is reached) together mask the whole vocabulary; lower min_tokens or loosen the constraint"
)
#: The id a row gets when its logits are not finite (NaN anywhere, or +inf): a broken model step
#: or logits processor. There is no distribution to sample (argmax over NaN picks token 0), so
#: the engine ends that request with :data:`NON_FINITE_MESSAGE`, the same way as ALL_MASKED.
NON_FINITE = -2
NON_FINITE_MESSAGE = (
    "RuntimeError: the logits for this request are not finite (NaN or +inf, from the model or a "
    "logits processor): no token can be sampled"
)


def invalid_token_message(token: int, vocab: int) -> str:
    """Why a sampled id outside ``[0, vocab)`` fails its request (an ``error`` field)."""
    if token == ALL_MASKED:
        return ALL_MASKED_MESSAGE
    if token == NON_FINITE:
        return NON_FINITE_MESSAGE
    return f"RuntimeError: the sampler picked token {token}, outside the vocabulary [0, {vocab})"


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to sample: the request's parameters and its history."""

    params: SamplingParams
    seed: int
    position: int  # position of the token being sampled
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    suppressed: tuple[int, ...] = ()  # e.g. EOS while min_tokens is not reached


def sampling_row(
    params: SamplingParams,
    seed: int,
    position: int,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    suppressed: tuple[int, ...] = (),
) -> SamplingRow:
    """``SamplingRow(...)`` without the frozen dataclass's per-field ``object.__setattr__`` (see
    :func:`.scheduler.scheduled_request`: one of these per sampled request every step)."""
    obj = object.__new__(SamplingRow)
    d = obj.__dict__
    d["params"], d["seed"], d["position"], d["prompt_token_ids"], d["output_token_ids"], d["suppressed"] = (
        params,
        seed,
        position,
        prompt_token_ids,
        output_token_ids,
        suppressed,
    )
    return obj


def row_seed(seed: int, position: int) -> int:
    """Mix (seed, position) into a 63-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """logits [N, V] float32 (one row per entry of ``rows``) -> one token id per row."""
        return self.sample_device(logits, rows).tolist()

    def sample_device(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Like calling the sampler, but the ids stay on the logits' device ([N] int64), so that
        a step can copy them back once, asynchronously, or feed them to the next step."""
        logits = logits.float()
        self._apply_penalties(logits, rows)
        masked = False
        for i, row in enumerate(rows):
            if row.suppressed:
                logits[i, _on(logits.device, list(row.suppressed))] = float("-inf")
            for process in row.params.logits_processors:  # e.g. a grammar's token mask
                logits[i] = process(row.output_token_ids, logits[i])
            masked = masked or bool(row.suppressed or row.params.logits_processors)
        top = logits.amax(dim=-1)  # [N]; NaN if any logit of the row is NaN
        # only masks can leave a row with nothing to sample; the flags stay on the device
        dead = torch.isneginf(top) if masked else None
        broken = torch.isnan(top) | torch.isposinf(top)
        out = self._choose(logits, rows).masked_fill(broken, NON_FINITE)
        return out if dead is None else out.masked_fill(dead, ALL_MASKED)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = [row.params.greedy for row in rows]
        out = torch.argmax(logits, dim=-1)  # greedy rows are done
        if not all(greedy):
            idx = [i for i, g in enumerate(greedy) if not g]
            if len(idx) == len(rows):
                return self._sample(logits, rows)
            where = _on(logits.device, idx)
            out = out.index_copy(0, where, self._sample(logits[where], [rows[i] for i in idx]))
        return out

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, row in enumerate(rows):
            p = row.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(
                    sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                    dtype=torch.long,
                    device=logits.device,
                )
                if seen.numel():
                    vals = logits[i, seen]
                    logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
                ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        temps = to_device(torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype), logits.device)
        logits = logits / temps[:, None]
        for i, row in enumerate(rows):
            logits[i] = _filter_row(logits[i], row.params)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            gen = torch.Generator(device=logits.device).manual_seed(row_seed(row.seed, row.position))
            noise[i].exponential_(generator=gen)
        return torch.argmax(probs / noise, dim=-1)


def _on(device: torch.device, ids: list[int]) -> torch.Tensor:
    """An index tensor on ``device``, copied without waiting for the device's queue."""
    return to_device(torch.tensor(ids, dtype=torch.long), device)


def _filter_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p exclude; [V] -> [V]."""
    neg_inf = float("-inf")
    if p.top_k and p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, neg_inf)
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= p.top_p  # keep the token that crosses
        drop_sorted[0] = False  # and always the most likely one (a top_p that is 0 in float32 dropped all)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), neg_inf)
    return logits
