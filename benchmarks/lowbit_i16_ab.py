"""kernels_i16.c of this checkout against another git revision's, per projection and row count:
CPU time of one thread, the two libraries alternating cell by cell in one process, and their
outputs compared bit for bit (a kernel change must keep every output element's bits).

    .venv/bin/python benchmarks/lowbit_i16_ab.py --rev main --rows 1,8,32,512 --threads 1
    .venv/bin/python benchmarks/lowbit_i16_ab.py --isa avx512vnni --rows 1,8,32,512,4096

With ``--isa``, both sides are this checkout's sources: "before" built for AVX2 (native.py's
baseline flags), "after" for the named instruction set (its extra flags, native._ISA_FLAGS).
``--build-isa`` builds both sides of a ``--rev`` comparison for one instruction set (default AVX2).

Why a second library and not two settings: the kernel has no switch for its old code; building
the other revision's kernels_i16.c beside this checkout's other sources gives the exact "before"
in the same process, so the machine's load (shared, 2 cores) hits both sides alike. Weights are
random packed blocks of SmolLM2-135M's shapes (benchmarks/lowbit_kernels.packed: q4 for the four
layer projections, q8 for the tied 49,152 x 576 head); each cell is the best of ``--repeats``
timings of enough calls for ~0.2 s per side. GFLOP/s = 2 M N K per call. With ``--threads 2``
the clock is wall time (the two threads' CPU would count spinning at barriers as work).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from lowbit_kernels import packed  # noqa: E402  (the same random weights)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = (
    ("qkv", 960, 576, "q4"),
    ("o", 576, 576, "q4"),
    ("gate+up", 3072, 576, "q4"),
    ("down", 576, 1536, "q4"),
    ("head", 49152, 576, "q8"),
)


def build(i16_source: str, out_dir: str, name: str, isa: str = "avx2") -> ctypes.CDLL:
    """The library with ``i16_source`` as kernels_i16.c and this checkout's other sources,
    compiled for ``isa``."""
    from deepinfer_core.lowbit import native

    path = os.path.join(out_dir, f"{name}.c")
    with open(path, "w") as f:
        f.write(i16_source)
    sources = [p for p in native._SOURCES if not p.endswith("kernels_i16.c")] + [path]
    so = os.path.join(out_dir, f"{name}.so")
    subprocess.run(
        [
            native.compiler_path(),
            *native._FLAGS,
            *native._ISA_FLAGS[isa],
            f"-I{os.path.dirname(native.__file__)}",
            "-o",
            so,
            *sources,
        ],
        check=True,
    )
    lib = ctypes.CDLL(so)
    native._declare(lib)
    return lib


def call(lib: ctypes.CDLL, x: torch.Tensor, w, y: torch.Tensor, threads: int) -> None:
    M, K = x.shape
    m_ptr = w.m.data_ptr() if w.m is not None else None
    lib.gemm_i16_act(
        x.data_ptr(),
        M,
        K,
        4 if w.kind == "q4" else 8,
        w.qs.data_ptr(),
        w.d.data_ptr(),
        m_ptr,
        w.qs.shape[0],
        y.data_ptr(),
        threads,
    )


def timed(fn, clock, reps: int) -> float:
    start = clock()
    for _ in range(reps):
        fn()
    return (clock() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="main", help="git revision whose kernels_i16.c is the 'before' side")
    parser.add_argument(
        "--isa",
        default="",
        help="compare this checkout built for AVX2 (before) and for this ISA (after) instead of --rev",
    )
    parser.add_argument(
        "--build-isa", default="avx2", help="with --rev: build both sides for this instruction set (native._ISA_FLAGS)"
    )
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 512])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated projection names (default: all)")
    parser.add_argument(
        "--run-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: whole 32-request runs (cpu_throughput.py's shape, --requests), the libraries alternating",
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument(
        "--step-rows",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[8, 32, 512],
        help="M of the second table: 30 distinct layers' four GEMMs (weights from memory) + the head up to 256 rows",
    )
    args = parser.parse_args()
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    with open(os.path.join(ROOT, "deepinfer_core/lowbit/kernels_i16.c")) as f:
        new_src = f.read()
    if args.isa:
        old_src, args.rev = new_src, "this checkout for AVX2"
    else:
        old_src = subprocess.run(
            ["git", "-C", ROOT, "show", f"{args.rev}:deepinfer_core/lowbit/kernels_i16.c"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    only = set(filter(None, args.only.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            "before": build(old_src, tmp, "before", "avx2" if args.isa else args.build_isa),
            "after": build(new_src, tmp, "after", args.isa or args.build_isa),
        }
        if args.run_ab:
            torch.set_num_threads(args.threads)
            run_ab(libs, args.requests, args.run_ab, args.rev)
            return
        built = f" for {args.isa}" if args.isa else f", both built for {args.build_isa}"
        print(
            f"kernels_i16.c of {args.rev} (before) vs this checkout{built} (after); {args.threads} thread(s), "
            f"{'thread CPU' if args.threads == 1 else 'wall'} clock, best of {args.repeats}, load average {os.getloadavg()[0]:.1f}\n"
        )
        print(
            "| matrix (N x K, kind) | M | before ms | before GFLOP/s | after ms | after GFLOP/s | after / before | bits equal |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for name, n, k, kind in SHAPES:
            if only and name not in only:
                continue
            w = packed(n, k, kind)
            for m in args.rows:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
                ys = {side: torch.empty(m, n) for side in libs}
                fns = {
                    side: (lambda lib=lib, y=ys[side]: call(lib, x, w, y, args.threads)) for side, lib in libs.items()
                }
                for fn in fns.values():
                    fn()
                equal = torch.equal(ys["before"], ys["after"])
                reps = max(1, int(0.2 / max(timed(fns["before"], clock, 1), 1e-6)))
                best = {side: float("inf") for side in libs}
                for _ in range(args.repeats):
                    for side, fn in fns.items():
                        best[side] = min(best[side], timed(fn, clock, reps))
                flop = 2 * m * n * k
                b, a = best["before"] * 1e3, best["after"] * 1e3
                print(
                    f"| {name} ({n} x {k}, {kind}) | {m} | {b:.3f} | {flop / b / 1e6:.1f} | {a:.3f} | {flop / a / 1e6:.1f} | "
                    f"{b / a:.2f}x | {'yes' if equal else 'NO'} |",
                    flush=True,
                )
        if args.step_rows:
            step_table(libs, args.step_rows, args.repeats, args.threads, clock)


def run_ab(libs: dict, requests: int, rounds: int, rev: str) -> None:
    """Whole runs shaped as cpu_throughput.py's (``requests`` prompts of 128 tokens, 128 new
    tokens, greedy, EOS ignored, one generate) on one engine, the native library the model's
    native call and GEMMs use swapped between runs (the attention backend keeps this checkout's,
    the same attention.c); process CPU and wall seconds, and the outputs compared."""
    import inspect

    from cpu_throughput import build_prompts

    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.lowbit import llama_decode, native, ops

    prompts = build_prompts(requests, 128)
    block_size = inspect.signature(LLM).parameters["block_size"].default
    llm = LLM(
        "smollm2-135m-instruct",
        device="cpu",
        max_num_seqs=requests,
        kv_cache_blocks=requests * -(-256 // block_size),
        enable_prefix_caching=False,
    )
    model = llm.engine.model
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)

    def use(lib) -> None:
        kernels = native.NativeKernels(lib)
        ops.load = llama_decode.load = lambda: kernels
        model._decode_plan = llama_decode.plan_for(model)

    use(libs["after"])
    llm.generate(
        [p[::-1] for p in prompts], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    runs: dict[str, list[tuple[float, float]]] = {side: [] for side in libs}
    tokens: dict[str, list] = {}
    load = os.getloadavg()[0]
    for _ in range(rounds):
        for side, lib in libs.items():
            use(lib)
            start, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[side].append((time.perf_counter() - start, time.process_time() - cpu))
            tokens.setdefault(side, [list(o.outputs[0].token_ids) for o in outs])
    print(
        f"{requests} requests x 128 prompt + 128 new tokens, {torch.get_num_threads()} thread(s), whole runs alternating, "
        f"load average before {load:.1f}, after {os.getloadavg()[0]:.1f}; outputs identical: {tokens['before'] == tokens['after']}\n"
    )
    print("| kernels_i16.c | runs | best wall s | median wall s | best CPU s | median CPU s | tok per CPU s (best) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for side, r in runs.items():
        walls, cpus = sorted(w for w, _ in r), sorted(c for _, c in r)
        name = f"{rev} (before)" if side == "before" else "this checkout (after)"
        print(
            f"| {name} | {len(r)} | {walls[0]:.2f} | {walls[len(r) // 2]:.2f} | {cpus[0]:.2f} | {cpus[len(r) // 2]:.2f} | "
            f"{128 * requests / cpus[0]:.1f} |"
        )


def step_table(libs: dict, rows: list[int], repeats: int, threads: int, clock) -> None:
    """A step's GEMMs as the model has them: 30 layers of distinct weights (~70 MB packed, so
    read from memory each step, not from cache) and the head for decode-sized M."""
    layers = [[packed(n, k, "q4", 100 * layer + i) for i, (_, n, k, _) in enumerate(SHAPES[:4])] for layer in range(30)]
    head = packed(SHAPES[4][1], SHAPES[4][2], "q8", 7)
    print("\nA step's GEMMs, 30 distinct layers (weights from memory) + the head up to 256 rows:\n")
    print("| M | before ms | before GFLOP/s | after ms | after GFLOP/s | after / before |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=torch.Generator().manual_seed(k)) for k in (576, 1536)}
        ys = {n: torch.empty(m, n) for n in (960, 576, 3072, 49152)}
        mats = [w for layer in layers for w in layer] + ([head] if m <= 256 else [])
        flop = sum(2 * m * w.qs.shape[0] * w.shape[1] for w in mats)

        def step(lib) -> None:
            for w in mats:
                call(lib, xs[w.shape[1]], w, ys[w.qs.shape[0]], threads)

        best = {side: float("inf") for side in libs}
        for side, lib in libs.items():
            step(lib)
        for _ in range(repeats):
            for side, lib in libs.items():
                best[side] = min(best[side], timed(lambda lib=lib: step(lib), clock, 1))
        b, a = best["before"] * 1e3, best["after"] * 1e3
        print(f"| {m} | {b:.1f} | {flop / b / 1e6:.1f} | {a:.1f} | {flop / a / 1e6:.1f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
