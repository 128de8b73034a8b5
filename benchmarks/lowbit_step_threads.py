"""How evenly the native decode step's threads work: this code's layer.c against another git revision's.

    OMP_WAIT_POLICY=passive .venv/bin/python benchmarks/lowbit_step_threads.py --rev 165c9ba --requests 32 --threads 2 --rounds 30
    .venv/bin/python benchmarks/lowbit_step_threads.py --rev main --file attention.c --at-step 64 --threads 1

``--file`` swaps another lowbit C file instead of layer.c (the other side's copy of that one file,
this checkout's for the rest); ``--at-step`` captures a later 32-row decode step (longer contexts).
The step's native phases (layer.c's phase_ms: GEMMs, attention, the rest) are printed per side.

Why per-thread CPU time: on a shared machine two threads' wall time mostly measures who else
runs (each barrier waits for a descheduled thread). With passive OpenMP waits a waiting thread
sleeps, so each thread's CPU time is its own work, and the busiest thread's CPU is what an idle
machine's wall would be at best; a serial stage shows as the gap between the threads. Both
libraries (the kernels of this checkout, ``layer.c`` of each side) are built here and called on
the same captured 32-row decode step (real SmolLM2 weights, caches and block tables), alternating;
their hidden states must be identical.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cpu_throughput import build_prompts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(layer_source: str, out_dir: str, name: str, file: str = "layer.c", isa: str = "avx2") -> ctypes.CDLL:
    from deepinfer_core.lowbit import native

    path = os.path.join(out_dir, f"{name}.c")
    with open(path, "w") as f:
        f.write(layer_source)
    sources = [p for p in native._SOURCES if os.path.basename(p) != file] + [path]
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


def thread_cpu_ms() -> dict[str, float]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0]) / 1e6
        except OSError:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rev", required=True, help="git revision whose deepinfer_core/lowbit/layer.c is the other side"
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--file", default="layer.c", help="the lowbit C file taken from --rev (the rest from this checkout)"
    )
    parser.add_argument("--at-step", type=int, default=1, help="capture the n-th decode step of --requests rows")
    parser.add_argument(
        "--isa",
        default=None,
        help="instruction set both sides are built for (native._ISA_FLAGS; default: the engine's choice)",
    )
    args = parser.parse_args()
    os.environ["DEEPINFER_ADAPTIVE_THREADS"] = "0"
    from deepinfer_core import LLM, SamplingParams

    old = subprocess.run(
        ["git", "-C", ROOT, "show", f"{args.rev}:deepinfer_core/lowbit/{args.file}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    with open(os.path.join(ROOT, "deepinfer_core/lowbit", args.file)) as f:
        new = f.read()
    R, T = args.requests, args.threads
    torch.set_num_threads(T)
    block_size = inspect.signature(LLM).parameters["block_size"].default
    blocks = R * max(3, -(-(128 + args.at_step + 8) // block_size))  # no preemption up to the captured step
    llm = LLM("smollm2-135m-instruct", device="cpu", max_num_seqs=R, kv_cache_blocks=blocks)
    engine, model = llm.engine, llm.engine.model
    for p in build_prompts(R, 128):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=args.at_step + 8, ignore_eos=True))
    seen: dict[str, list[torch.Tensor]] = {}
    count = [0]
    while "args" not in seen and engine.has_unfinished_requests():
        engine.step()
        plan = model._decode_plan
        if plan is not None and not hasattr(plan, "_captures"):
            call = plan._call

            def capture(ids, positions, slots, tables, out, decode, call=call):
                if decode and ids.shape[0] == R:
                    count[0] += 1
                    if count[0] == args.at_step:
                        seen["args"] = [t.clone() for t in (ids, positions, slots, tables)]
                return call(ids, positions, slots, tables, out, decode)

            plan._call, plan._captures = capture, True
    ids, positions, slots, tables = seen["args"]
    from deepinfer_core.lowbit import native

    isa = args.isa or native.isa_choice()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            f"{args.file} of {args.rev}": build(old, tmp, "old", args.file, isa),
            f"{args.file} of this checkout": build(new, tmp, "new", args.file, isa),
        }
    outs = {k: torch.empty(R, plan._md.hidden) for k in libs}
    scratch = torch.empty(R * plan._per_row)
    busy: dict[str, list[list[float]]] = {k: [] for k in libs}
    wall: dict[str, list[float]] = {k: [] for k in libs}
    phases: dict[str, list[list[float]]] = {k: [] for k in libs}
    phase_ms = (ctypes.c_double * 3)()
    for _ in range(args.rounds):
        for name, lib in libs.items():
            phase_ms[0] = phase_ms[1] = phase_ms[2] = 0.0
            before, start = thread_cpu_ms(), time.perf_counter()
            lib.llama_decode_step(
                ctypes.byref(plan._md),
                plan._layers,
                ids.data_ptr(),
                positions.data_ptr(),
                slots.data_ptr(),
                tables.data_ptr(),
                tables.shape[1],
                R,
                scratch.data_ptr(),
                outs[name].data_ptr(),
                T,
                phase_ms,
            )
            wall[name].append((time.perf_counter() - start) * 1e3)
            after = thread_cpu_ms()
            busy[name].append(sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)[:T])
            phases[name].append(list(phase_ms))
    a, b = outs.values()
    print(
        f"{isa} build, {R} rows, {T} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average {os.getloadavg()[0]:.1f}, "
        f"{args.rounds} steps each, alternating, contexts {int(positions.min()) + 1}-{int(positions.max()) + 1} tokens; "
        f"hidden states identical: {torch.equal(a, b)}\n"
    )
    print(
        "| library | busiest thread CPU ms (median) | other threads (median) | wall ms (median) | phases CPU ms: GEMMs / attention / rest (median) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in libs:
        cols = [statistics.median(x[i] for x in busy[name]) for i in range(T)]
        ph = " / ".join(f"{statistics.median(x[i] for x in phases[name]):.1f}" for i in (0, 1, 2))
        print(
            f"| {name} | {cols[0]:.1f} | {' / '.join(f'{c:.1f}' for c in cols[1:])} | {statistics.median(wall[name]):.1f} | {ph} |"
        )


if __name__ == "__main__":
    main()
