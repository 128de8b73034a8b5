"""The engine's host (Python) time per stage, with a forward that costs nothing: a 64 x 512-token
prefill up to the forward call, and one steady 256-request decode step.

Why: on the H200 a 64 x 512 prefill waited 11-14 ms for the host before its first kernel (against
~66 ms of GPU work) and a 256-request decode step took 6.8-12.6 ms against a 3.1 ms graph replay
(benchmarks/README.md, gpu_throughput). Both are host work that a CPU measures as well as a GPU
host does: here the model's ``forward`` returns a preallocated hidden-state tensor and
``compute_logits`` a small zero tensor, so what is timed is the engine alone (validation,
scheduling, block allocation, batch building, sampling bookkeeping, output building).

The model is a random DeepSeek-V3 with V3-mini's vocabulary (129,280) and tiny layers, run as
``gpu_throughput.py`` runs its speed engine: prefix caching off, overlapped scheduling on,
``max_num_seqs`` 256, a 32,768-token step budget. Each stage's CPU time is its own (time in
stages it calls is the callee's), measured with ``time.thread_time_ns``; "other" is the rest of
``generate`` (the request streams, the step loop). The totals are measured again without the
stage clocks, whose own cost (~4 us a wrapped call) the stage sums include.

``--before REV`` runs the engine of git revision REV in alternate child processes (its
``deepinfer_core`` from ``git archive``, first on ``PYTHONPATH``; this checkout's is copied at the
start the same way), the peer in the same run; the machine's load hits both alike, and each figure
is the median over ``--rounds`` processes.

    .venv/bin/python benchmarks/gpu/engine_host_time.py --before 9bbfe2d --rounds 5
    .venv/bin/python benchmarks/gpu/engine_host_time.py --gc-freeze-ab --rounds 5   # gc.freeze() after start-up or not
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 129_280  # V3-mini's
PREFILL = (64, 512)
DECODE = (256, 128, 32)  # requests, prompt tokens, timed steps


# -- child: one engine, stage clocks -------------------------------------------------------------
class StageClock:
    """Exclusive CPU time per named stage: a stage's time excludes the stages it calls. A read
    of the thread's CPU clock is a system call (~1.7 us here), so only calls made once per step
    or per request of a prefill are wrapped (the wall clock is cheaper but, on a shared machine,
    counts other processes' time)."""

    def __init__(self) -> None:
        self.cpu: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[list] = []

    def wrap(self, owner, attr: str, name: str) -> None:
        if not hasattr(owner, attr):
            return  # not in this revision
        fn = getattr(owner, attr)
        clock = self

        @functools.wraps(fn)
        def timed(*a, **kw):
            frame = [time.thread_time_ns(), 0]
            clock._stack.append(frame)
            try:
                return fn(*a, **kw)
            finally:
                clock._stack.pop()
                spent = time.thread_time_ns() - frame[0]
                clock.cpu[name] = clock.cpu.get(name, 0) + spent - frame[1]
                clock.calls[name] = clock.calls.get(name, 0) + 1
                if clock._stack:
                    clock._stack[-1][1] += spent

        setattr(owner, attr, timed)

    def take(self) -> dict[str, float]:
        out = {k: v / 1e6 for k, v in self.cpu.items()}
        self.cpu.clear()
        self.calls.clear()
        return out


def make_checkpoint(path: str) -> None:
    import torch
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path)


def child(path: str, repeats: int, frozen: bool = True) -> dict:
    import torch

    torch.set_num_threads(1)
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.engine import llm_engine, model_runner, overlap, scheduler

    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=256, max_num_batched_tokens=64 * 512,
              kv_cache_blocks=1200, enable_prefix_caching=False, overlap_scheduling=True)  # fmt: skip
    model = llm.engine.model
    hidden = torch.zeros(64 * 512, model.config["hidden_size"])
    logits = torch.zeros(256, 64)
    first_forward: list[int] = []

    def forward(input_ids, positions, kv_caches, meta):
        if not first_forward:
            first_forward.append(time.thread_time_ns())
        return hidden[: input_ids.shape[0]]

    model.forward = forward  # a forward that costs nothing: only the engine's host work is timed
    model.compute_logits = lambda h: logits[: h.shape[0]]
    g = torch.Generator().manual_seed(0)
    n, length = PREFILL
    prefill_prompts = [torch.randint(2, VOCAB, (n, length), generator=g).tolist() for _ in range(repeats + 1)]
    rn, rlen, steps = DECODE
    decode_prompts = [torch.randint(2, VOCAB, (rn, rlen), generator=g).tolist() for _ in range(2 * repeats + 2)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=1 + steps, ignore_eos=True)
    if frozen:  # --gc-freeze-ab's peer does without: nothing frozen, as in a process that never calls gc.freeze
        gc.collect()
        gc.freeze()  # the prompt sets held here (~1M ids in lists) are not the engine's: no full collection walks them

    def run(prompts, params) -> tuple[float, float]:
        first_forward.clear()
        t0 = time.thread_time_ns()
        llm.generate(prompts, params)
        return (first_forward[0] - t0) / 1e6, (time.thread_time_ns() - t0) / 1e6

    # plain runs (no stage clocks): the headline figures
    run(prefill_prompts[-1], one)
    run(decode_prompts[-1], many)
    prefill = [run(prefill_prompts[i], one) for i in range(repeats)]
    step = [
        (run(decode_prompts[2 * i], many)[1] - run(decode_prompts[2 * i + 1], one)[1]) / steps for i in range(repeats)
    ]

    clock = StageClock()
    from deepinfer_core import LLM as LLMClass

    for owner, attr, name in (
        (LLMClass, "generate", "other (generate, request streams)"),
        (LLMClass, "_encode", "prompts: encode"),
        (llm_engine.LLMEngine, "validate", "check requests (LLM._submit)"),  # before check_batch
        (llm_engine.LLMEngine, "check_batch", "check requests (LLM._submit)"),
        (llm_engine.LLMEngine, "add_request", "add requests"),  # before add_checked
        (llm_engine.LLMEngine, "add_checked", "add requests"),
        (llm_engine.LLMEngine, "step", "other (engine step)"),
        (scheduler.Scheduler, "schedule", "schedule"),
        (llm_engine.LLMEngine, "_sampling_rows", "sampling rows"),
        (overlap, "continuation", "continuation (overlap)"),
        (overlap, "alive", "commit checks (overlap)"),
        (model_runner, "build", "batch build"),
        (model_runner.ModelRunner, "launch", "runner: sample + launch"),
        (model_runner.ModelRunner, "collect", "runner: collect ids"),
        (scheduler.Scheduler, "update", "scheduler update"),
        (llm_engine.LLMEngine, "_commit", "commit: outputs (stop checks, snapshots)"),
    ):
        clock.wrap(owner, attr, name)

    stages_prefill = []
    for i in range(repeats):
        clock.take()
        llm.generate(prefill_prompts[i], one)
        stages_prefill.append(clock.take())
    stages_decode = []
    for i in range(repeats):
        clock.take()
        llm.generate(decode_prompts[2 * i], many)
        a = clock.take()
        llm.generate(decode_prompts[2 * i + 1], one)
        b = clock.take()
        stages_decode.append({k: (a.get(k, 0.0) - b.get(k, 0.0)) / steps for k in a.keys() | b.keys()})
    med = lambda rows: {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]}  # noqa: E731
    return {
        "prefill_before_forward_ms": statistics.median(p[0] for p in prefill),
        "prefill_generate_ms": statistics.median(p[1] for p in prefill),
        "decode_step_ms": statistics.median(step),
        "prefill_stages": med(stages_prefill),
        "decode_stages": med(stages_decode),
    }


# -- parent: alternate revisions, print the tables ---------------------------------------------
def export(rev: str, into: str) -> str:
    root = Path(__file__).resolve().parents[2]
    tar = subprocess.run(["git", "archive", rev, "deepinfer_core"], cwd=root, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=tar, check=True)
    return into


def spawn(path: str, repeats: int, pythonpath: str | None, frozen: bool = True) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--child", path, "--repeats", str(repeats)] + ([] if frozen else ["--not-frozen"])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(title: str, key: str, runs: dict[str, list[dict]], totals: dict[str, str]) -> None:
    names = list(runs)
    med = {
        n: {k: statistics.median(r[key].get(k, 0.0) for r in runs[n]) for k in set().union(*(r[key] for r in runs[n]))}
        for n in names
    }
    stages = sorted(
        set().union(*(m.keys() for m in med.values())), key=lambda k: -max(m.get(k, 0.0) for m in med.values())
    )
    print(f"\n{title} (CPU ms, median of {len(runs[names[0]])} processes)\n")
    print("| stage | " + " | ".join(names) + (" | before / now |" if len(names) == 2 else " |"))
    print("|---|" + "---:|" * (len(names) + (len(names) == 2)))
    for k in stages + ["(stage clocks' sum)", *totals]:
        if k == "(stage clocks' sum)":
            vals = [sum(med[n].values()) for n in names]
        elif k in totals:
            vals = [statistics.median(r[k] for r in runs[n]) for n in names]
        else:
            vals = [med[n].get(k, 0.0) for n in names]
        ratio = (
            f" | {vals[0] / vals[1]:.2f}x" if len(names) == 2 and vals[1] > 0 else (" | " if len(names) == 2 else "")
        )
        print(f"| {totals.get(k, k)} | " + " | ".join(f"{v:.2f}" for v in vals) + ratio + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="git revision whose engine is the peer")
    ap.add_argument("--rounds", type=int, default=3, help="child processes per revision (alternating)")
    ap.add_argument("--repeats", type=int, default=3, help="timed prefills / decode runs per process")
    ap.add_argument(
        "--gc-freeze-ab",
        action="store_true",
        help="this checkout only: nothing frozen vs everything frozen (gc.freeze) after start-up",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--not-frozen", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.repeats, not args.not_frozen)))
        return
    with tempfile.TemporaryDirectory(prefix="engine_host_time") as tmp:
        ckpt = os.path.join(tmp, "v3")
        make_checkpoint(ckpt)
        now = os.path.join(
            tmp, "now"
        )  # this checkout's engine as it is at the start (edits during the run do not count)
        shutil.copytree(
            Path(__file__).resolve().parents[2] / "deepinfer_core",
            os.path.join(now, "deepinfer_core"),
            ignore=shutil.ignore_patterns("__pycache__", "*.so"),
        )
        variants: dict[str, str | None] = {"now": now}
        frozen = {"now": True}
        if args.gc_freeze_ab:
            variants, frozen = (
                {"no gc.freeze": now, "frozen after start-up": now},
                {"no gc.freeze": False, "frozen after start-up": True},
            )
        elif args.before:
            os.makedirs(os.path.join(tmp, "before"))
            variants = {f"before ({args.before})": export(args.before, os.path.join(tmp, "before")), "now": now}
            frozen = dict.fromkeys(variants, True)
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, pythonpath in variants.items():
                runs[name].append(spawn(ckpt, args.repeats, pythonpath, frozen[name]))
        print(
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}, torch on one thread"
        )
        table(
            f"{PREFILL[0]} x {PREFILL[1]} prefill, generate(max_tokens=1)",
            "prefill_stages",
            runs,
            {
                "prefill_before_forward_ms": "**host before the forward, no stage clocks**",
                "prefill_generate_ms": "**whole generate, no stage clocks**",
            },
        )
        table(
            f"one {DECODE[0]}-request decode step ({DECODE[1]}-token prompts, mean of {DECODE[2]} steps)",
            "decode_stages",
            runs,
            {"decode_step_ms": "**the step, no stage clocks**"},
        )
        print("\nper process (the spread):")
        for name, rs in runs.items():
            for key in ("prefill_before_forward_ms", "prefill_generate_ms", "decode_step_ms"):
                print(f"  {name}, {key}: " + ", ".join(f"{r[key]:.2f}" for r in rs))


if __name__ == "__main__":
    main()
