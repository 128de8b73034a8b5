"""Where a decode step's time goes, several engine variants alternated on one GPU machine.

    python benchmarks/gpu/step_host_ab.py --old path/to/older/tree --rounds 3 --json out.json

Why: the 23:00 final run (benchmarks/README.md, code of 6ef834b) read the V3-mini 256-request
decode step at 4.16 / 4.36 ms (bf16) and 4.33 ms (FP8) against 3.34 / 3.47 and 2.92 ms at 20:04
(code of 7acce1b), with a faster graph replay, and DeepSeek-V4-mini's one-request step at 3.12 ms
"with overlapped scheduling" against 2.51 ms without, in the same engine. Two readings taken an
hour apart on two lent machines cannot say whether the code or the machine moved.

Each variant is a child process holding one engine: this checkout's code with ``DEEPINFER_PDL``
1 or 0, or ``--old``'s tree (its ``deepinfer_core`` and ``plugins/deepinfer_cuda_sm100`` first on
``PYTHONPATH``). All children build at once; the parent then asks them in turn, ``--rounds``
times round-robin, to measure, so every variant sees the same machine within seconds of the
others (the idle ones hold their GPU memory and do nothing). Per measure, as
``gpu_throughput.di_speed`` times decode (time of 1 + 32 new tokens minus time of 1, over 32):

* ``step``: decode ms/step;
* ``wait``: of it, the time the host sat blocked on a step's sampled ids (``ModelRunner.collect``'s
  event wait), so ``host = step - wait`` is the engine's own host time a step (scheduling, batch
  build, launches, commit) when the step is bound by the host, and the time the GPU waited on it;
* ``gc``: the garbage collector's time a step (``gc.callbacks``).

Once per engine: the decode graph's replay (CUDA events), the eager LM head + argmax that buckets
above ``graphs.HEAD_ROWS`` leave to the engine, the greedy tokens of a fixed batch (every variant
must produce the same ids: PDL and the code between the two commits change no arithmetic), and
with ``--cprofile`` the host's cProfile of one 256-request generate.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "@@STEPAB "


# -- child: one engine, measures on request --------------------------------------------------------
def child(spec: dict) -> None:
    sys.path.insert(0, HERE)
    import torch
    from gpu_throughput import di_greedy, random_prompts, replay_ms

    import deepinfer_core
    import deepinfer_cuda_sm100
    from deepinfer_core import LLM, SamplingParams

    cuda = spec["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def say(obj) -> None:
        sys.stdout.write(MARK + json.dumps(obj) + "\n")
        sys.stdout.flush()

    t0 = time.perf_counter()
    llm = LLM(
        spec["path"],
        device=spec["device"],
        dtype="bfloat16" if cuda else "float32",
        enable_prefix_caching=False,
        max_num_seqs=spec["max_seqs"],
        max_num_batched_tokens=64 * 512,
        kv_cache_blocks=spec["blocks"],
    )  # gpu_throughput's speed engine
    engine, runner = llm.engine, llm.engine.runner
    pdl_on = None
    try:
        from deepinfer_cuda_sm100.kernels import pdl

        pdl_on = pdl.enabled(torch.zeros(1, device=spec["device"]))
    except ImportError:  # an older tree without PDL
        pass
    clocks = {"wait": 0.0, "gc": 0.0}
    collect = runner.collect

    def timed_collect(launched):
        if launched.result is None and launched.ready is not None:
            t = time.perf_counter()
            launched.ready.synchronize()
            clocks["wait"] += time.perf_counter() - t
        return collect(launched)

    runner.collect = timed_collect
    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            clocks["gc"] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)
    vocab = spec["vocab"]
    configured_overlap = engine.overlap
    say(
        {
            "ready": True,
            "build_s": time.perf_counter() - t0,
            "core": os.path.dirname(deepinfer_core.__file__),
            "plugin": os.path.dirname(deepinfer_cuda_sm100.__file__),
            "pdl": pdl_on,
            "overlap": configured_overlap,
            "env_pdl": os.environ.get("DEEPINFER_PDL"),
        }
    )

    def run(prompts, params) -> tuple[float, float, float]:
        clocks["wait"] = clocks["gc"] = 0.0
        sync()
        t = time.perf_counter()
        llm.generate(prompts, params)
        sync()
        return time.perf_counter() - t, clocks["wait"], clocks["gc"]

    warmed = set()
    steps = spec["steps"]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=1 + steps, ignore_eos=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "measure":
            n, seed = cmd["n"], cmd["seed"]
            engine.overlap = configured_overlap and cmd["overlap"]
            if (n, engine.overlap) not in warmed:
                llm.generate(random_prompts(n, 128, vocab, 10 + n), many)
                warmed.add((n, engine.overlap))
            p1, p2 = random_prompts(n, 128, vocab, seed), random_prompts(n, 128, vocab, seed + 1)
            a, b = run(p1, one), run(p2, many)
            engine.overlap = configured_overlap
            say({k: 1e3 * (y - x) / steps for k, x, y in zip(("step", "wait", "gc"), a, b)})
        elif cmd["op"] == "finish":
            out: dict = {"replay": {}, "head": {}}
            graphs = getattr(runner, "graphs", None)
            table = getattr(graphs, "graphs", None) or getattr(getattr(graphs, "v4", None), "graphs", None) or {}
            for n in cmd["levels"]:
                g = table.get(n)
                if g is not None:
                    out["replay"][n] = min(replay_ms(g) for _ in range(3))
                from deepinfer_cuda_sm100 import graphs as gmod

                if cuda and n > gmod.HEAD_ROWS and hasattr(engine.model, "compute_logits"):
                    h = torch.randn(n, engine.model.config["hidden_size"], dtype=torch.bfloat16, device="cuda")
                    head = lambda: torch.argmax(engine.model.compute_logits(h).float(), dim=-1)  # noqa: E731
                    head()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(20):
                        head()
                    e.record()
                    torch.cuda.synchronize()
                    out["head"][n] = s.elapsed_time(e) / 20
            n = max(cmd["levels"])
            out["tokens"] = di_greedy(llm, random_prompts(n, 128, vocab, 999), 8)
            if cmd.get("cprofile"):
                import cProfile
                import io
                import pstats

                prompts = random_prompts(n, 128, vocab, 1234)
                prof = cProfile.Profile()
                prof.enable()
                llm.generate(prompts, many)
                sync()
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
                out["cprofile"] = buf.getvalue()[-4000:]
            say(out)
            return


# -- parent ----------------------------------------------------------------------------------------
class Variant:
    def __init__(self, name: str, spec: dict, env: dict, log) -> None:
        self.name, self.spec = name, spec
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.info: dict | None = None
        self.log = log

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            self.log(f"  [{self.name}] {line.rstrip()}")
        raise RuntimeError(f"{self.name}: child ended (rc {self.proc.wait()})")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    name = "?"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{gpu}, host CPU {name} x {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--old",
        default=None,
        help="an older tree (deepinfer_core/ and plugins/deepinfer_cuda_sm100/) run as a peer variant",
    )
    ap.add_argument("--models", default="v3mini,v3mini-fp8,v4mini")
    ap.add_argument(
        "--codes",
        default="pdl1,pdl0,old",
        help="variants of each model: this checkout with DEEPINFER_PDL=1 / 0, --old's tree",
    )
    ap.add_argument(
        "--levels", default="1,64,256", help="V3-mini batch sizes (the largest also timed with serial steps)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument(
        "--cprofile", action="store_true", help="one 256-request generate under cProfile in each bf16 variant"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="check the plumbing on the CPU: tiny random models, float32")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0

    sys.path.insert(0, HERE)
    import torch
    from gpu_throughput import V3_MINI, log, make_fp8, make_v3mini, make_v4mini

    log(machine())
    tmp = tempfile.mkdtemp(prefix="stepab")
    models = args.models.split(",")
    variants: list[Variant] = []
    codes = [("pdl1", None, "1"), ("pdl0", None, "0")] + ([("old", os.path.abspath(args.old), "1")] if args.old else [])
    codes = [c for c in codes if c[0] in args.codes.split(",")]

    def spawn(model: str, path: str, levels: list[int], codes_here, vocab: int = V3_MINI["vocab_size"]) -> None:
        for code, tree, pdl in codes_here:
            env = dict(os.environ, DEEPINFER_PDL=pdl, PYTHONUNBUFFERED="1")
            if tree:
                env["PYTHONPATH"] = os.pathsep.join(
                    [tree, os.path.join(tree, "plugins", "deepinfer_cuda_sm100"), env.get("PYTHONPATH", "")]
                )
            spec = {
                "path": path,
                "vocab": vocab,
                "device": "cpu" if args.tiny else "cuda",
                "steps": args.steps,
                "levels": levels,
                "max_seqs": max(levels + [64]),
                "blocks": max(max(levels) * 2 + 300, 64 * 5 + 16),
            }  # fmt: skip  (gpu_throughput's speed engine)
            variants.append(Variant(f"{model}/{code}", spec, env, log))

    t = time.perf_counter()
    levels_v3 = [1, 8] if args.tiny else [int(x) for x in args.levels.split(",")]
    if any(m.startswith("v3mini") for m in models):
        bf = os.path.join(tmp, "v3mini")
        if args.tiny:
            from engine_host_time import make_checkpoint

            make_checkpoint(bf)
        else:
            make_v3mini(bf)
            torch.cuda.empty_cache()
        log(f"v3mini written at {time.perf_counter() - t:.0f}s")
        if "v3mini" in models:
            spawn("v3mini", bf, levels_v3, codes)
        if "v3mini-fp8" in models:
            fp8 = os.path.join(tmp, "v3mini-fp8")
            os.makedirs(fp8)
            for f in os.listdir(bf):  # weights hard-linked (the rewrite unlinks them here), the rest copied
                (os.link if f.endswith(".safetensors") else shutil.copy)(os.path.join(bf, f), os.path.join(fp8, f))
            make_fp8(fp8, device="cpu" if args.tiny else "cuda")
            torch.cuda.empty_cache()
            log(f"v3mini-fp8 written at {time.perf_counter() - t:.0f}s")
            spawn("v3mini-fp8", fp8, levels_v3, codes)
    if "v4mini" in models:
        v4 = os.path.join(tmp, "v4mini")
        if args.tiny:
            from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint

            write_tiny_v4_checkpoint(v4, weights="bf16", experts="bf16", config=TINY_V4_CONFIG, shards=1)
        else:
            make_v4mini(v4)
            torch.cuda.empty_cache()
        log(f"v4mini written at {time.perf_counter() - t:.0f}s")
        spawn("v4mini", v4, [1], [c for c in codes if c[0] != "old"], vocab=512 if args.tiny else V3_MINI["vocab_size"])
    for v in variants:
        v.info = v.read()
        log(
            f"{v.name}: built in {v.info['build_s']:.0f}s; core {v.info['core']}; PDL {v.info['pdl']}; engine.overlap "
            f"{v.info['overlap']}"
        )
    log(f"all engines ready at {time.perf_counter() - t:.0f}s")

    # measures: (n, overlap as configured or serial); round-robin over variants, same prompts per round
    res: dict[str, dict[str, list[dict]]] = {v.name: {} for v in variants}
    for r in range(args.rounds):
        for v in variants:
            plan = [(n, True) for n in v.spec["levels"]] + [(max(v.spec["levels"]), False)]
            for n, ov in plan:
                got = v.ask(op="measure", n=n, overlap=ov, seed=1000 * r + n)
                log(
                    f"  round {r + 1} {v.name} {n}{'' if ov else ' serial'}: step {got['step']:.3f} wait "
                    f"{got['wait']:.3f} gc {got['gc']:.3f} ms"
                )
                res[v.name].setdefault(f"{n}{'' if ov else ' serial'}", []).append(got)
        log(f"round {r + 1} done at {time.perf_counter() - t:.0f}s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine(), "measures": res}, f, indent=1)
    extras = {
        v.name: v.ask(op="finish", levels=v.spec["levels"], cprofile=args.cprofile and v.name.startswith("v3mini/"))
        for v in variants
    }
    for v in variants:
        v.proc.wait()

    log(f"\n{machine()}; {args.rounds} rounds, each variant in turn; ms per decode step")
    log(
        "| variant | requests | step ms (each round) | wait ms | host = step - wait | gc ms | replay ms | eager head "
        "ms |"
    )
    log("|---|---|---|---|---|---|---|---|")
    for v in variants:
        for key, rows in res[v.name].items():
            n = int(key.split()[0])
            med = lambda k: statistics.median(x[k] for x in rows)  # noqa: E731
            rep = extras[v.name]["replay"].get(str(n), extras[v.name]["replay"].get(n))
            head = extras[v.name]["head"].get(str(n), extras[v.name]["head"].get(n))
            each = " / ".join(f"{x['step']:.2f}" for x in rows)
            log(
                f"| {v.name} | {key} | {each} | {med('wait'):.2f} | {med('step') - med('wait'):.2f} | {med('gc'):.2f} "
                f"| "
                f"{'' if rep is None else f'{rep:.3f}'} | {'' if head is None else f'{head:.3f}'} |"
            )
    for model in models:
        toks = {v.name: extras[v.name]["tokens"] for v in variants if v.name.startswith(model + "/")}
        names = list(toks)
        same = all(toks[n] == toks[names[0]] for n in names)
        log(f"greedy tokens, {model}, {len(toks[names[0]])} requests x 8, identical across {', '.join(names)}: {same}")
    for v in variants:
        if "cprofile" in extras[v.name]:
            log(
                f"\ncProfile, {v.name}, one {max(v.spec['levels'])}-request generate of {1 + args.steps} "
                f"tokens:\n{extras[v.name]['cprofile']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine(),
                    "info": {v.name: v.info for v in variants},
                    "measures": res,
                    "extras": {k: {kk: vv for kk, vv in e.items() if kk != "tokens"} for k, e in extras.items()},
                },
                f,
                indent=1,
            )
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
