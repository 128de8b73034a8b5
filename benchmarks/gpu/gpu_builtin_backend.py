"""The builtin pure-torch backend on a CUDA GPU: exactness against transformers, and throughput.

Runs the same engine code as the CPU path (no GPU kernels of our own yet) to show that the
scheduler / runner / attention metadata work unchanged on a torch device, and what that costs.

    python benchmarks/gpu/gpu_builtin_backend.py --model smollm2-135m-instruct

Prints two tables: greedy agreement and logit error versus transformers (float32, same GGUF,
same GPU), then output tokens/s for deepinfer and transformers ``generate`` at several
concurrencies (bfloat16), with ratios and peak GPU memory.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.loading import resolve_model_path
from deepinfer_core.plugin_host import default_host

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Give me a tip for learning to code.",
]  # fmt: skip


def load_hf(path: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    kw = {"gguf_file": name} if name.endswith(".gguf") else {}
    folder = folder if kw else path
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw).cuda().eval()
    return tok, model


def exactness(path: str, new_tokens: int) -> None:
    llm = LLM(path, device="cuda", dtype="float32", kv_cache_blocks=64)
    tok, hf = load_hf(path, torch.float32)
    outs = llm.chat(
        [[{"role": "user", "content": q}] for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=new_tokens)
    )
    same, worst = 0, 0.0
    for out in outs:
        ids = out.prompt_token_ids
        ref_new, logits = _hf_greedy(hf, ids, new_tokens, set(llm.get_tokenizer().stop_token_ids))
        got = out.outputs[0].token_ids
        same += int(got == ref_new)
        if got != ref_new:
            d = next((i for i, (x, y) in enumerate(zip(got, ref_new)) if x != y), min(len(got), len(ref_new)))
            seq = ids + ref_new[:d]
            with torch.no_grad():
                theirs = hf(torch.tensor([seq], device="cuda")).logits[0, -1].float()
            ours = llm.engine.prompt_logits(seq)[-1]
            top = theirs.topk(2)
            print(
                f"  diverges at token {d}/{len(ref_new)}: ours {got[d : d + 1]} transformers {ref_new[d : d + 1]}, "
                f"transformers' top-2 margin there {float(top.values[0] - top.values[1]):.2e}, logits max diff "
                f"{float((theirs - ours).abs().max()):.2e}"
            )
        mine = _last_logits(llm, ids)
        worst = max(worst, (mine - logits).abs().max().item())
    print("\n| check (float32, CUDA) | result |\n|---|---|")
    print(f"| greedy {new_tokens}-token chat outputs identical to transformers | {same}/{len(outs)} |")
    print(f"| last-position logits, max abs diff | {worst:.2e} |")
    del llm, hf
    torch.cuda.empty_cache()


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], new_tokens: int, stop_ids: set[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by full forwards of transformers' model, stopping on the same ids as
    the engine (transformers versions disagree on the EOS id of this GGUF: 5.17 keeps going
    after ``<|im_end|>``)."""
    seq, first_logits = list(ids), None
    for _ in range(new_tokens):
        logits = hf(torch.tensor([seq], device="cuda")).logits[0, -1].float()
        first_logits = logits if first_logits is None else first_logits
        seq.append(int(logits.argmax()))
        if seq[-1] in stop_ids:
            break
    return seq[len(ids) :], first_logits


def _last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    return llm.engine.prompt_logits(ids)[-1]


def throughput(path: str, concurrency: list[int], prompt_tokens: int, new_tokens: int, dtype: str) -> None:
    tdtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    rows = []
    llm = LLM(
        path,
        device="cuda",
        dtype=dtype,
        kv_cache_blocks=max(concurrency) * 3,
        max_num_seqs=max(concurrency),
        max_num_batched_tokens=8192,
    )
    vocab = llm.engine.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([[5] * prompt_tokens], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    results = {}
    for n in concurrency:
        prompts = torch.randint(100, vocab - 100, (n, prompt_tokens), generator=g).tolist()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        results[n] = (n * new_tokens / dt, torch.cuda.max_memory_allocated() / 2**20)
    del llm
    torch.cuda.empty_cache()
    tok, hf = load_hf(path, tdtype)
    with torch.no_grad():
        hf.generate(torch.full((1, prompt_tokens), 5, device="cuda"), max_new_tokens=4, do_sample=False)
        for n in concurrency:
            prompts = torch.randint(100, vocab - 100, (n, prompt_tokens), generator=g).cuda()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            out = hf.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            assert out.shape[1] == prompt_tokens + new_tokens
            ours, mem = results[n]
            theirs = n * new_tokens / dt
            rows.append((n, ours, theirs, ours / theirs, mem, torch.cuda.max_memory_allocated() / 2**20))
    print(
        f"\n| concurrent | deepinfer tok/s | transformers tok/s | ratio | deepinfer peak MiB | transformers peak MiB | "
        f" ({dtype}, {prompt_tokens}-token prompts, {new_tokens} new tokens, {torch.cuda.get_device_name()})"
    )
    print("|---|---|---|---|---|---|")
    for n, ours, theirs, ratio, m1, m2 in rows:
        print(f"| {n} | {ours:.0f} | {theirs:.0f} | {ratio:.2f}x | {m1:.0f} | {m2:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-exactness", action="store_true")
    args = ap.parse_args()
    path = resolve_model_path(args.model, default_host())
    print(f"platform: {default_host().platform('cuda')!r}, torch {torch.__version__}")
    if not args.skip_exactness:
        exactness(path, 64)
    throughput(path, [int(c) for c in args.concurrency.split(",")], args.prompt_tokens, args.new_tokens, args.dtype)


if __name__ == "__main__":
    main()
