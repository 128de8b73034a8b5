"""Check an engine's greedy outputs against a reference model, token by token, teacher-forced.

Why not compare whole generations: two correct engines whose sums differ in the last ulps part
ways at the first near-tie, and every later token then follows a different prefix, so "identical
outputs" fails on healthy engines and says nothing once they part. Here the reference (e.g. the
dequantized float32 model) reads each request's prompt plus the engine's own output in one
forward (``LLMEngine.prompt_logits``), and every output token must be the reference's greedy
choice at that prefix, or within ``tolerance`` of its largest logit (a near-tie). A wrong KV
write, a bad attention mask, a lost or reordered request or a corrupted cache after preemption
give tokens whole logits away from the reference's choice. :func:`mixed_prompts` and
:func:`run_arriving` make the batches such checks need (mixed lengths, requests arriving while
others decode).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.sampling_params import SamplingParams

__all__ = ["GreedyMiss", "GreedyReport", "assert_same_or_near_tie", "check_greedy", "mixed_prompts", "run_arriving"]


@dataclass(frozen=True)
class GreedyMiss:
    """One output token the reference would not have chosen."""

    request: int  # index into the prompts
    index: int  # position in that request's output
    token: int
    reference_token: int
    gap: float  # reference logit of its choice minus that of the engine's token (> tolerance)


@dataclass(frozen=True)
class GreedyReport:
    tokens: int  # output tokens checked
    exact: int  # of them, the reference's own argmax
    worst_gap: float  # the largest logit gap among the tokens that were not the argmax (0.0: none)
    misses: tuple[GreedyMiss, ...]


def check_greedy(reference, prompts: list[list[int]], outputs: list[list[int]], tolerance: float) -> GreedyReport:
    """``reference``: an ``LLMEngine`` (``LLM(...).engine``) with KV blocks for the longest
    prompt + output; ``outputs[i]``: the engine's greedy tokens for ``prompts[i]``."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    tokens = exact = 0
    worst = 0.0
    misses: list[GreedyMiss] = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        if not output:
            continue
        logits = reference.prompt_logits(list(prompt) + list(output)[:-1])[len(prompt) - 1 :]  # [len(output), V]
        best = logits.argmax(dim=-1)
        for j, token in enumerate(output):
            tokens += 1
            gap = float(logits[j, best[j]] - logits[j, token])
            if gap <= 0.0:
                exact += 1
                continue
            worst = max(worst, gap)
            if gap > tolerance:
                misses.append(GreedyMiss(i, j, int(token), int(best[j]), gap))
    return GreedyReport(tokens, exact, worst, tuple(misses))


def mixed_prompts(tokenizer, count: int, lengths: tuple[int, ...], text: str) -> list[list[int]]:
    """``count`` token windows 3 tokens apart over ``text`` repeated, lengths cycling through ``lengths``."""
    ids = tokenizer.encode(
        text * (1 + (max(lengths) + 3 * count) // max(1, len(tokenizer.encode(text, add_special_tokens=False)))),
        add_special_tokens=False,
    )
    return [ids[i * 3 : i * 3 + lengths[i % len(lengths)]] for i in range(count)]


def run_arriving(llm, prompts: list[list[int]], new_tokens: int, waves: int) -> list[list[int]]:
    """Greedy outputs, the prompts added in ``waves`` groups, two engine steps apart."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    size = -(-len(prompts) // waves)
    order: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    pending = [prompts[i : i + size] for i in range(0, len(prompts), size)]
    while pending or engine.has_unfinished_requests():
        if pending:
            for prompt in pending.pop(0):
                order[engine.add_request(prompt, params)] = len(order)
        for _ in range(2):
            for out in engine.step():
                if out.finished:
                    outputs[order[out.request_id]] = list(out.outputs[0].token_ids)
    return [outputs[i] for i in range(len(prompts))]


def assert_same_or_near_tie(
    got: list[list[int]], want: list[list[int]], prompts: list[list[int]], hf, margin: float = 1e-4
) -> None:
    """Two engines' greedy token lists must be identical; where one pair parts, transformers'
    float32 model ``hf`` must call the two tokens at the first difference a near-tie (logits
    within ``margin``), else it is a bug, not rounding. (After a near-tie the two continue from
    different prefixes, so only the first difference says anything.)"""
    import torch

    for i, (a, b, p) in enumerate(zip(got, want, prompts)):
        if a == b:
            continue
        assert len(a) == len(b), f"request {i}: {len(a)} tokens vs the reference's {len(b)}"
        j = next(j for j in range(len(a)) if a[j] != b[j])
        with torch.no_grad():
            logits = hf(torch.tensor([p + a[:j]])).logits[0, -1].double()
        gap = abs((logits[a[j]] - logits[b[j]]).item())
        assert gap < margin, (
            f"request {i} (prompt {len(p)} tokens) differs at token {j}: {a[j]} vs {b[j]}, transformers' margin "
            f"{gap:.2e}"
        )
