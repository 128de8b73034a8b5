"""Start-up: process start to first token of ``deepinfer generate --chat --stream``, cold and warm,
with the default (low-bit on CPU) and ``--dtype float32``, next to llama.cpp (llama-cpp-python)
opening the same GGUF and streaming its first chat token, in the same run.

    .venv/bin/python benchmarks/cpu/startup.py --repeats 3 --before 262da3f

*cold*: an empty start-up cache directory (``DEEPINFER_CACHE_DIR``); *warm*: the directory a
cold run of the same configuration left behind (an untimed one when only ``--caches warm`` is
asked for). *last token -> exit*: from the last byte the process writes on stdout to its exit. The compiled low-bit
kernels live elsewhere
(``~/.cache/deepinfer/lowbit-*.so``) and are warm in both: a first untimed run per code version
builds them. ``--before REV`` also times the code of git revision REV (``git archive`` into a
temporary directory, put first on ``PYTHONPATH``; core and plugins both from REV), so the table
holds before and after from one run. Each measurement is its own process; configurations
alternate within each repeat so load drift on a shared machine hits all of them alike; the
median is shown. Not part of the test suite: tests never time things.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "What is the capital of France?"
LLAMACPP_CHILD = r"""
import sys, time
import llama_cpp
t0 = time.perf_counter()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
verbose=False)
print(f"LOAD {time.perf_counter() - t0:.4f}", file=sys.stderr, flush=True)
for chunk in llm.create_chat_completion([{"role": "user", "content": sys.argv[3]}], max_tokens=4, temperature=0.0,
stream=True):
    text = chunk["choices"][0]["delta"].get("content")
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
"""


@dataclass(frozen=True)
class Config:
    label: str
    code: str  # "after" | a revision | "llama.cpp"
    dtype: str  # "auto" | "float32" | ""
    cache: str  # "cold" | "warm" | ""


@dataclass(frozen=True)
class Timing:
    first_token_s: float
    exit_s: float
    last_output_s: float  # the last byte on stdout (the last token)
    load_s: float | None  # llama.cpp's own model load (the Llama constructor)
    text: str


def time_process(cmd: list[str], env: dict[str, str], cwd: str) -> Timing:
    """Seconds from spawning ``cmd`` to the first byte it writes on stdout, and to its exit.
    ``cwd`` must not be a source tree: ``python -m`` puts it first on ``sys.path``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)
    first = os.read(proc.stdout.fileno(), 1)
    first_s = last_s = time.perf_counter() - start
    chunks = [first]
    while chunk := os.read(proc.stdout.fileno(), 65536):
        chunks.append(chunk)
        last_s = time.perf_counter() - start
    err = proc.stderr.read()
    proc.wait()
    exit_s = time.perf_counter() - start
    rest = b"".join(chunks[1:])
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed ({proc.returncode}): {err.decode()[-2000:]}")
    load = next((float(line.split()[1]) for line in err.decode().splitlines() if line.startswith("LOAD ")), None)
    return Timing(first_s, exit_s, last_s, load, (first + rest).decode(errors="replace").strip()[:20])


def deepinfer_cmd(model: str, dtype: str, threads: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "deepinfer_core.entrypoints",
        "generate",
        "--model",
        model,
        "--chat",
        "--stream",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--threads",
        str(threads),
        "--dtype",
        dtype,
        PROMPT,
    ]


def source_tree(rev: str, root: str) -> str:
    """``rev``'s files under ``root``; returns the PYTHONPATH that makes them win over the
    editable installs (the core and every plugin package)."""
    archive = subprocess.run(["git", "-C", REPO, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    plugins = os.path.join(root, "plugins")
    paths = [root] + sorted(
        os.path.join(plugins, p) for p in os.listdir(plugins) if os.path.isdir(os.path.join(plugins, p))
    )
    return os.pathsep.join(paths)


def main() -> None:
    from deepinfer_core.models.sources import smollm2_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=smollm2_gguf(), help="a GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--before", metavar="REV", help="also time this git revision's code (e.g. the commit before a change)"
    )
    ap.add_argument("--dtypes", default="auto,float32", help="deepinfer --dtype values to time (comma-separated)")
    ap.add_argument("--caches", default="cold,warm", help="start-up cache states to time (comma-separated)")
    ap.add_argument("--json", default=None, help="write the result file (benchmarks/bench_json.py's schema)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="deepinfer-startup-")
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # cold runs leave 0.5 GiB float32 entries


def run(args: argparse.Namespace, work: str) -> None:
    base_env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "DEEPINFER_LOG_LEVEL": "warning"}
    codes = {"after": {**base_env, "PYTHONPATH": ""}}
    if args.before:
        tree = os.path.join(work, "before")
        os.makedirs(tree)
        codes[args.before] = {**base_env, "PYTHONPATH": source_tree(args.before, tree)}
    configs = [
        Config(f"{'deepinfer ' + code if code != 'after' else 'deepinfer'} {dtype} {cache}", code, dtype, cache)
        for code in codes
        for dtype in args.dtypes.split(",")
        for cache in args.caches.split(",")
    ]
    try:
        import llama_cpp  # noqa: F401

        configs.append(Config("llama.cpp (llama-cpp-python)", "llama.cpp", "", ""))
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp row (pip install llama-cpp-python)")
    for code, env in codes.items():  # untimed: builds each version's low-bit kernels once
        where = subprocess.run(
            [sys.executable, "-c", "import deepinfer_core; print(deepinfer_core.__file__)"],
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        print(f"code {code}: {where}", flush=True)
        time_process(
            deepinfer_cmd(args.model, "auto", args.threads),
            {**env, "DEEPINFER_CACHE_DIR": os.path.join(work, "prime")},
            work,
        )
    shutil.rmtree(os.path.join(work, "prime"), ignore_errors=True)

    timings: dict[Config, list[Timing]] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        for config in configs:
            if config.code == "llama.cpp":
                cmd = [sys.executable, "-c", LLAMACPP_CHILD, args.model, str(args.threads), PROMPT]
                timings[config].append(time_process(cmd, base_env, work))
                continue
            cache = os.path.join(work, f"{config.code}-{config.dtype}-{repeat}")
            if config.cache == "cold":
                shutil.rmtree(cache, ignore_errors=True)
            env = {**codes[config.code], "DEEPINFER_CACHE_DIR": cache}
            if config.cache == "warm" and not os.path.isdir(cache):  # --caches warm alone: fill it, untimed
                time_process(deepinfer_cmd(args.model, config.dtype, args.threads), env, work)
            timings[config].append(time_process(deepinfer_cmd(args.model, config.dtype, args.threads), env, work))
            if config.cache == "warm":
                shutil.rmtree(cache, ignore_errors=True)
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    report(args, timings)


def report(args: argparse.Namespace, timings: dict[Config, list[Timing]]) -> None:
    median = {c: statistics.median(t.first_token_s for t in ts) for c, ts in timings.items()}
    peer = next((c for c in timings if c.code == "llama.cpp"), None)
    load = os.getloadavg()[0]
    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} thread(s), "
        f"load {load:.1f} at the end, median of {args.repeats}; model {os.path.basename(args.model)}"
    )
    rows = [  # the table's rows, printed and (--json) written
        {
            "engine": config.label,
            "first_token_s": round(median[config], 2),
            "exit_s": round(statistics.median(t.exit_s for t in ts), 2),
            "last_token_to_exit_s": round(statistics.median(t.exit_s - t.last_output_s for t in ts), 2),
            "runs_first_token_s": [round(t.first_token_s, 2) for t in ts],
            "x_llamacpp": round(median[config] / median[peer], 2) if peer is not None else None,
        }
        for config, ts in timings.items()
    ]
    print("| configuration | first token s | exit s | last token -> exit s | runs (first token s) | / llama.cpp |")
    print("|---|---:|---:|---:|---|---:|")
    for r in rows:
        runs = ", ".join(f"{t:.2f}" for t in r["runs_first_token_s"])
        ratio = "-" if r["x_llamacpp"] is None else f"{r['x_llamacpp']:.2f}x"
        print(f"| {r['engine']} | {r['first_token_s']:.2f} | {r['exit_s']:.2f} | {r['last_token_to_exit_s']:.2f} | "
              f"{runs} | {ratio} |")  # fmt: skip
    if peer is not None:
        loads = [t.load_s for t in timings[peer] if t.load_s is not None]
        if loads:
            print(f"\nllama.cpp's own model load (the Llama constructor): median {statistics.median(loads):.3f} s")
    print("first tokens: " + "; ".join(f"{c.label}: {ts[0].text!r}" for c, ts in timings.items()))
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import bench_json

        bench_json.write(
            args.json, "startup", rows, peer="llama.cpp (llama-cpp-python) opening the same GGUF in a fresh process",
            notes=f"{args.threads} thread(s), median of {args.repeats}, load {load:.1f} at the end",
        )  # fmt: skip


if __name__ == "__main__":
    main()
