"""How far the default's prefill logits lie from the float32 model's, per way of prefilling.

    .venv/bin/python benchmarks/prefill_logits_distance.py

The 16 chat prompts of ``lowbit_agreement.py`` are prefilled in one batch (one new token each)
by the dequantized float32 model (the reference) and by the default (packed Q4_1 weights,
float16 KV cache) with its prefill done four ways on one engine: the torch ops
(``DEEPINFER_NATIVE_PREFILL=0``), and the native call with the decode attention kernel
(``DEEPINFER_PREFILL_ATTENTION=0``), with ``prefill_attention.c`` reading every key from the cache
(1), and with it taking the call's own keys and values in float32 (2, the default). The model's
final hidden state of every prompt position goes through the LM head; printed: the mean and the
largest |logit - reference logit| over all positions and the vocabulary, and at how many positions
the argmax differs from the reference's. Why: greedy agreement over 128 tokens counts prompts,
16 of them; the logits say in which direction a change moves, and by how much.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from lowbit_agreement import PROMPTS  # noqa: E402

WAYS = (("torch ops (DEEPINFER_NATIVE_PREFILL=0)", False, 2), ("native, decode attention kernel (mode 0, before)", True, 0),
        ("native, prefill_attention.c, keys from the cache (mode 1)", True, 1),
        ("native, prefill_attention.c, the call's own in float32 (mode 2, default)", True, 2))  # fmt: skip


def prompt_logits(llm, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of every prompt position, in the engine's token order [T, V]."""
    from deepinfer_core import SamplingParams

    model = llm.engine.model
    forward, hidden = model.forward, []

    def capture(input_ids, positions, kv_caches, meta):
        out = forward(input_ids, positions, kv_caches, meta)
        if meta.max_query_len > 1:
            hidden.append(out.detach().clone())
        return out

    model.forward = capture
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    finally:
        del model.forward
    with torch.no_grad():
        return torch.cat([model.compute_logits(h) for h in hidden])


def main() -> None:
    from deepinfer_core import LLM

    torch.set_num_threads(1)
    common = dict(device="cpu", kv_cache_blocks=40, max_num_seqs=16, enable_prefix_caching=False)
    dense = LLM("smollm2-135m-instruct", dtype="float32", **common)
    tok = dense.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    reference = prompt_logits(dense, prompts)
    llm = LLM("smollm2-135m-instruct", **common)
    llm.generate([prompts[0]], use_tqdm=False)  # builds the plan
    plan = llm.engine.model._decode_plan
    print(f"16 chat prompts, {sum(map(len, prompts))} prompt positions; load average {os.getloadavg()[0]:.1f}\n")
    print("| prefill | mean abs logit diff | max abs logit diff | positions whose argmax differs |")
    print("|---|---:|---:|---:|")
    for name, native, mode in WAYS:
        plan.prefill, plan.prefill_attention = native, mode
        got = prompt_logits(llm, prompts)
        diff = (got - reference).abs()
        flips = int((got.argmax(-1) != reference.argmax(-1)).sum())
        print(f"| {name} | {diff.mean():.5f} | {diff.max():.4f} | {flips} |", flush=True)


if __name__ == "__main__":
    main()
