"""Tiny DeepSeek-V4 prefill on CPU: the batched compressors and indexer top-k
(``deepseek_v4_prefill``) against the per-request loops they replaced, alternating in one process
on one engine, so the machine's load hits both alike.

The earlier code is read from git (``--before REV``: ``deepseek_v4_compress.py`` of the last
commit with the loops), loaded as a module, and swapped into the running model for its rounds
(``update_entries``, ``Indexer.select`` and their helpers); the engine, weights and prompts stay.
The model is ``v4_cpu_decode.py``'s random V4 (6 layers: sliding, CSA, HCA, CSA, HCA, sliding;
CSA rate 4 with index_topk 64, so prompts past 256 tokens are ranked). Per batch shape: best of
``--rounds`` prefills (one new token each) per code, wall and CPU seconds, the CPU seconds
spent inside the compressors + indexer, the torch ops they issue (each a kernel launch on a GPU, where
host time per op is what bounded V4 prefill), and whether both codes sample the same first tokens.

    .venv/bin/python benchmarks/v4_prefill.py --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.deepseek_v4 import compress as now
from deepinfer_core.models.deepseek_v4 import model as deepseek_v4

BEFORE = "e0a468e"  # main before the batching: per-request compressor loops, per-position indexer top-k
SHAPES = {"8 x 512": [512] * 8, "32 x 160": [160] * 32, "mixed 9": [3, 16, 100, 257, 300, 512, 700, 1000, 1500]}


def load_v4_cpu_decode():
    spec = importlib.util.spec_from_file_location("v4_cpu_decode", Path(__file__).with_name("v4_cpu_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_before(rev: str):
    """``deepseek_v4_compress`` as it was at ``rev``, as a module of the installed package."""
    root = Path(__file__).resolve().parent.parent
    src = subprocess.run(
        ["git", "show", f"{rev}:deepinfer_core/models/deepseek_v4/compress.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    name = "deepinfer_core.models._v4_compress_before"
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    mod.__package__ = "deepinfer_core.models"
    sys.modules[name] = mod
    exec(compile(src, f"{rev}:deepseek_v4_compress.py", "exec"), mod.__dict__)
    return mod


class Ops(TorchDispatchMode):
    """Counts non-view torch ops (what a GPU would launch one kernel each for), in all and inside
    the compressors + indexer."""

    def __init__(self, code: Code) -> None:
        super().__init__()
        self.code, self.total, self.inside = code, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rets = func._schema.returns
        info = rets[0].alias_info if rets else None
        if info is None or info.is_write:
            self.total += 1
            self.inside += self.code.depth > 0
        return func(*args, **(kwargs or {}))


class Code:
    """Swaps one version of the compressor / indexer functions into the model, timing them."""

    def __init__(self, before) -> None:
        self.inside, self.depth = 0.0, 0
        plain = {
            "update_entries": now.update_entries, "select": now.Indexer.select,
            "compress": getattr(now.Compressor, "compress", None), "_top": getattr(now.Indexer, "_top", None),
            "entry_index": getattr(now.V4Batch, "entry_index", None),
        }  # fmt: skip
        old = {"update_entries": before.update_entries, "select": before.Indexer.select, "compress": before.Compressor.compress,
               "_top": before.Indexer._top, "entry_index": before.V4Batch.entry_index}  # fmt: skip
        self.versions = {"before": old, "now": plain}

    def timed(self, fn):
        def run(*args, **kwargs):
            t = time.process_time()
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self.inside += time.process_time() - t

        return run

    def use(self, version: str) -> None:
        v = self.versions[version]
        deepseek_v4.update_entries = self.timed(v["update_entries"])
        now.Indexer.select = self.timed(v["select"])
        for owner, name in ((now.Compressor, "compress"), (now.Indexer, "_top"), (now.V4Batch, "entry_index")):
            if v[name] is None:
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, v[name])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu_decode = load_v4_cpu_decode()
    code = Code(load_before(args.before))
    shapes = [s for s in SHAPES if s in args.shapes.split(",")]
    g = torch.Generator().manual_seed(3)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as path:
        cpu_decode.build(path)
        budget = max(sum(SHAPES[s]) for s in shapes)
        llm = LLM(
            path,
            device="cpu",
            max_num_seqs=32,
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,
            kv_cache_blocks=256,
        )
        for shape in shapes:
            prompts = [
                torch.randint(2, cpu_decode.CONFIG["vocab_size"], (n,), generator=g).tolist() for n in SHAPES[shape]
            ]
            timings: dict[str, list] = {"before": [], "now": []}
            firsts = {}
            for version in ("before", "now") * (args.rounds + 1):  # the first pair warms up
                code.use(version)
                code.inside = 0.0
                w, c = time.perf_counter(), time.process_time()
                out = llm.generate(prompts, one)
                timings[version].append((time.perf_counter() - w, time.process_time() - c, code.inside))
                firsts.setdefault(version, [o.outputs[0].token_ids for o in out])
            for version in ("before", "now"):
                code.use(version)
                with Ops(code) as ops:
                    llm.generate(prompts, one)
                runs = timings[version][1:]  # the warm-up round is not counted
                rows.append((shape, sum(SHAPES[shape]), version, min(r[0] for r in runs), min(r[1] for r in runs), min(r[2] for r in runs),
                             ops.inside, ops.total, firsts["before"] == firsts["now"]))  # fmt: skip
        code.use("now")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"tiny DeepSeek-V4 prefill (v4_cpu_decode.py's random model), float32, {args.threads} thread(s), best of {args.rounds} "
        f"alternating rounds; {platform.machine()}, load {os.getloadavg()[0]:.1f}; now = {rev}, before = {args.before}\n"
    )
    print(
        "| batch | code | wall s | CPU s | compressors + indexer CPU s | torch ops: compressors + indexer / all | prefill tok/s | CPU speed-up | same first tokens |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for i, (shape, tokens, version, wall, cpu, inside, ops_in, ops_all, same) in enumerate(rows):
        ratio = f"{rows[i - 1][4] / cpu:.2f}x" if version == "now" else ""
        print(
            f"| {shape} | {version} | {wall:.3f} | {cpu:.3f} | {inside:.3f} | {ops_in:,} / {ops_all:,} | {tokens / wall:,.0f} | {ratio} | {'yes' if same else 'NO'} |"
        )


if __name__ == "__main__":
    main()
