"""DeepSeek-V4 SWA bounded replay: compact's error against exact replay, and the prefill it saves.

    python benchmarks/kv/swa_replay.py --json benchmarks/results/swa_replay.json

Part 1, error: for every V4 config the tests use (tests/test_deepseek_v4_configs.py's table, the
tiny V4 of deepinfer_core.testing.v4_tiny) plus a window-128 model (DeepSeek's window, 8 layers),
random weights, float32 on CPU. Each engine first serves ``--prompts`` base prompts of ``--context``
+ ``--suffix`` tokens, so their blocks are in the prefix cache; then a prompt of the same ``--context``
tokens + ``--suffix`` new ones hits ``--context`` cached tokens and its window state is rebuilt by
replay (window cache off). The peer is exact replay in the same run: its greedy ``--new`` tokens
and logits at each step. Compact (``keep`` = the layout's minimum, ``140 * window / 128`` and 140; the
window-128 model also at ``--long-context``, past its exact replay length, with keep 256 / 512 / 768)
is teacher-forced along exact's tokens (a logits processor records the logits, then forces exact's
token), so every step compares logits at the same context: KL(exact || compact) per step (mean,
max) and greedy agreement (compact's argmax = exact's token). A third engine without prefix
caching checks that exact replay is exact (its KL against no cache). Where ``keep`` reaches the
layout's exact replay length, compact is exact replay (marked "= exact").

Part 2, prefill tokens computed per request (``RequestOutput.metrics["swa_num_replayed_tokens"]`` +
uncached prompt tokens) as the cached context grows, on the window-128 model: exact replay grows
with the context until ``layers * (window - 1) + window``, compact stays at ``keep``; the line for
the released DeepSeek-V4-Flash layout (43 layers) is computed from its layout, not run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests"))

W128 = dict(sliding_window=128, num_hidden_layers=8, mlp_layer_types=["hash_moe"] + ["moe"] * 7)


def model_dirs(root: str, wanted: set[str] | None):
    """(name, checkpoint dir, block size) for every config measured (``wanted``: those names only;
    the window-128 model is always saved: part 2 runs on it), random weights."""
    import test_deepseek_v4_configs as table
    import transformers

    from deepinfer_core.testing.v4_tiny import randomise_zero_initialised, save_tiny_v4, tiny_v4_config

    S, C, H = table.S, table.C, table.H
    out = []
    path = os.path.join(root, "w128")
    layers = [S, C, H, C, H, C, H, S]
    save_tiny_v4(path, seed=7, randomise_seed=8, config=tiny_v4_config(layer_types=layers, **W128))
    if wanted is None or "window128_8layers" in wanted:
        out.append(("window128_8layers", path, 128))
    if wanted is None or "tiny_v4" in wanted:
        path = os.path.join(root, "tiny_v4")
        save_tiny_v4(path, seed=4321, randomise_seed=6)
        out.append(("tiny_v4", path, 128))
    for name, (overrides, _, _) in table.CONFIGS.items():
        if wanted is not None and name not in wanted:
            continue
        path = os.path.join(root, name)
        torch.manual_seed(len(name))
        hf = transformers.DeepseekV4ForCausalLM(table.config(**overrides)).eval()
        randomise_zero_initialised(hf, 3)
        hf.save_pretrained(path)
        out.append((name, path, table.BLOCK_SIZES.get(name, 128)))
    return out


class Recorder:
    """A logits processor: records each step's logits; with ``force``, then allows only that token."""

    def __init__(self, force: list[int] | None = None) -> None:
        self.logits: list[torch.Tensor] = []
        self.force = force

    def __call__(self, output_ids, logits):
        self.logits.append(logits.detach().float().clone())
        if self.force is None:
            return logits
        masked = torch.full_like(logits, float("-inf"))
        masked[self.force[len(output_ids)]] = 0.0
        return masked


def engine(path: str, block: int, **options):
    from deepinfer_core import LLM

    return LLM(path, device="cpu", dtype="float32", kv_cache_blocks=48, block_size=block, **options)


def run_hits(llm, bases, queries, new: int, force=None):
    """Serve the bases (fills the prefix cache), then each query; per query (tokens, logits, output)."""
    from deepinfer_core import SamplingParams

    llm.generate(bases, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    out = []
    for i, q in enumerate(queries):
        rec = Recorder(None if force is None else force[i])
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logits_processors=[rec])
        o = llm.generate([q], params, use_tqdm=False)[0]
        out.append((o.outputs[0].token_ids, torch.stack(rec.logits), o))
    return out


def compare(ref, got) -> dict:
    """KL(ref || got) per step, greedy agreement of got's argmax with ref's tokens."""
    kls, agree, steps = [], 0, 0
    for (tokens, ref_logits, _), (_, logits, _) in zip(ref, got):
        p = torch.log_softmax(ref_logits.double(), -1)
        q = torch.log_softmax(logits.double(), -1)
        kls += (p.exp() * (p - q)).sum(-1).clamp(min=0).tolist()
        agree += int((logits.argmax(-1) == torch.tensor(tokens)).sum())
        steps += len(tokens)
    return {"kl_mean": sum(kls) / len(kls), "kl_max": max(kls), "agreement": agree / steps, "steps": steps}


def error_rows(models, args, context: int, more_keeps: tuple[int, ...] = ()) -> list[dict]:
    rows = []
    for name, path, block in models:
        llm = engine(path, block, window_cache_seconds=0)
        layout = llm.engine.model.kv_layout(block)
        exact_n, min_keep = layout.exact_replay_tokens, layout.min_replay_tokens
        window = llm.engine.model.cfg.window
        vocab = llm.engine.model.vocab_size
        context = context // block * block
        g = torch.Generator().manual_seed(len(name) + 101)
        bases, queries = [], []
        for _ in range(args.prompts):
            # as long as the query: the indexer ranks a prompt row over the whole prompt's entries, so
            # under exact score ties a prefix's cached KV depends on its prompt's length (transformers too)
            base = torch.randint(2, vocab, (context + args.suffix,), generator=g).tolist()
            bases.append(base)
            queries.append(base[:context] + torch.randint(2, vocab, (args.suffix,), generator=g).tolist())
        start = time.perf_counter()
        exact = run_hits(llm, bases, queries, args.new)
        assert all(o.num_cached_tokens == context for _, _, o in exact), name
        fresh = run_hits(engine(path, block, enable_prefix_caching=False), bases, queries, args.new)
        sanity = compare(fresh, exact)
        keeps = sorted({min_keep, max(min_keep, math.ceil(140 * window / 128)), 140, *more_keeps})
        for keep in keeps:
            if keep >= exact_n:
                got, note = exact, "= exact"
            else:
                compact = engine(path, block, window_cache_seconds=0, swa_replay="compact", swa_replay_keep=keep)
                got = run_hits(compact, bases, queries, args.new, force=[t for t, _, _ in exact])
                note = ""
            replayed = [o.metrics["swa_num_replayed_tokens"] for _, _, o in got]
            row = {
                "config": name,
                "window": window,
                "layers": len(layout.layers),
                "context": context,
                "exact_replay_tokens": exact_n,
                "exact_replayed": [o.metrics["swa_num_replayed_tokens"] for _, _, o in exact],
                "keep": keep,
                "replayed": replayed,
                "note": note,
                "exact_vs_no_cache_kl_max": sanity["kl_max"],
                "exact_vs_no_cache_agreement": sanity["agreement"],
                **compare(exact, got),
            }
            rows.append(row)
            print(
                f"| {name} | {window} | {row['layers']} | {context} | {exact_n} | {keep}{' ' + note if note else ''} | "
                f"{row['kl_mean']:.2e} | {row['kl_max']:.2e} | {row['agreement']:.3f} | {row['steps']} | "
                f"{sanity['kl_max']:.1e} / {sanity['agreement']:.3f} |",
                flush=True,
            )
        print(f"<!-- {name}: {time.perf_counter() - start:.1f} s -->", file=sys.stderr, flush=True)
    return rows


def prefill_rows(path: str, args) -> list[dict]:
    """Prefill tokens computed for one request hitting ``context`` cached tokens, per mode."""
    from deepinfer_core import SamplingParams

    rows = []
    g = torch.Generator().manual_seed(3)
    for context in args.contexts:
        base = torch.randint(2, 320, (context + args.suffix,), generator=g).tolist()
        query = base[:context] + torch.randint(2, 320, (args.suffix,), generator=g).tolist()
        row = {"context": context, "suffix": args.suffix, "no_cache": len(query)}
        for mode in ("exact", "compact"):
            llm = engine(path, 128, window_cache_seconds=0, swa_replay=mode)
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            llm.generate([base], params, use_tqdm=False)
            o = llm.generate([query], params, use_tqdm=False)[0]
            assert o.num_cached_tokens == context
            row[f"{mode}_replayed"] = o.metrics["swa_num_replayed_tokens"]
            row[mode] = o.metrics["swa_num_replayed_tokens"] + len(query) - o.num_cached_tokens
        row["compact_over_exact"] = row["compact"] / row["exact"]
        rows.append(row)
        print(
            f"| {context} | {row['no_cache']} | {row['exact']} ({row['exact_replayed']}) | "
            f"{row['compact']} ({row['compact_replayed']}) | {row['compact_over_exact']:.2f} |",
            flush=True,
        )
    return rows


def flash_line(contexts, suffix: int) -> dict:
    """The released V4-Flash layout's replay lengths (computed from its config, no weights)."""
    import transformers

    from deepinfer_core.models.deepseek_v4.kv import v4_kv_layout

    layout = v4_kv_layout(transformers.DeepseekV4Config().to_dict(), torch.bfloat16, 128)
    exact = layout.exact_replay_tokens
    return {
        "layers": len(layout.layers),
        "exact_replay_tokens": exact,
        "min_replay_tokens": layout.min_replay_tokens,
        "per_context": [
            {"context": c, "exact": min(c, exact) + suffix, "compact": min(c, 140) + suffix} for c in contexts
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512, help="cached tokens before the hit (part 1)")
    parser.add_argument("--long-context", type=int, default=1536, help="the window-128 model again at this context")
    parser.add_argument("--suffix", type=int, default=8, help="new prompt tokens after the hit")
    parser.add_argument("--new", type=int, default=16, help="greedy tokens compared per prompt")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per config")
    parser.add_argument("--contexts", default="256,512,1024,2048,3072", help="part 2's cached contexts")
    parser.add_argument("--configs", default="", help="comma-separated config names (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the result file (bench_json.py)")
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    import logging

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as root:
        models = model_dirs(root, set(args.configs.split(",")) if args.configs else None)
        print(
            f"Part 1: compact vs exact replay after a prefix hit of the context, {args.suffix} new prompt tokens, "
            f"{args.new} greedy tokens x {args.prompts} prompts per config (compact teacher-forced on exact's tokens)\n"
        )
        print(
            "| config | window | layers | context | exact replays | keep | KL mean | KL max | greedy agreement | steps "
            "| exact vs no cache: KL max / agreement |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        )
        errors = error_rows(models, args, args.context)
        if args.long_context:  # the window-128 model again, past its exact replay length
            w128 = [(n, p, b) for n, p, b in models if n == "window128_8layers"]
            errors += error_rows(w128, args, args.long_context, (256, 512, 768))
        print(
            f"\nPart 2: prefill tokens computed for one request whose first N tokens hit the prefix cache "
            f"(+{args.suffix} new), window-128 8-layer model (replayed tokens in parentheses)\n"
        )
        print(
            "| cached context | no cache | exact replay | compact (keep 140) | compact / exact |\n"
            "|---:|---:|---:|---:|---:|"
        )
        prefill = prefill_rows(os.path.join(root, "w128"), args)
    flash = flash_line(args.contexts, args.suffix)
    print(
        f"\nDeepSeek-V4-Flash layout ({flash['layers']} layers, computed): exact replay "
        f"{flash['exact_replay_tokens']} tokens, compact 140 (minimum keep {flash['min_replay_tokens']})"
    )
    if args.json:
        import bench_json

        bench_json.write(
            args.json,
            "swa_replay",
            errors,
            peer="exact replay in the same run (and no prefix cache, for exact's own check)",
            notes="random-weight V4 configs, float32 CPU; compact teacher-forced on exact's greedy tokens",
            prefill=prefill,
            flash_layout=flash,
        )


if __name__ == "__main__":
    main()
