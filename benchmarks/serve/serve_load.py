"""Load on ``deepinfer serve`` vs llama.cpp's server, and vs deepinfer's offline ``LLM``.

N concurrent clients (the official ``openai`` SDK, one thread each) stream ``/v1/completions``
from each server on SmolLM2-135M-Instruct (the same Q4_1 GGUF), each a distinct prompt of about
``--prompt-tokens`` tokens, asking for exactly ``--new-tokens`` tokens (greedy; EOS ignored:
``ignore_eos`` for deepinfer, a -inf logit bias on EOS for llama.cpp). Per level the table shows
time to first token and inter-token latency (p50 / p99 over all requests / gaps, client side),
output tokens per second of the whole level (wall clock), and ratios: deepinfer serve over
llama.cpp's server, and deepinfer serve over deepinfer's offline ``LLM.generate`` on the same
prompts (the issue's goal: the server costs at most 10% at 32 clients).

Each server runs in its own subprocess with the same thread count; offline runs in a subprocess
too. All three are started first and measured in turn at each level (``--repeats`` rounds,
best of each), so that the ratios compare runs minutes apart at most, not a whole run apart,
on a shared machine whose load drifts. An engine that cannot run is reported as unavailable,
and the others still run.

    python benchmarks/serve/serve_load.py --concurrency 1,8,32 --prompt-tokens 128 --new-tokens 128
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

MODEL = "smollm2-135m-instruct"
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, "
    "it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of "
    "Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, we had nothing "
    "before us, we were all going direct to Heaven, we were all going direct the other way. "
) * 4


def prompts(n: int, prompt_tokens: int) -> list[str]:
    """Distinct prompts of about ``prompt_tokens`` tokens (4 characters a token, roughly)."""
    words = TEXT.split()
    size = prompt_tokens * 3 // 4
    return [f"Request {i}: " + " ".join(words[i % 40 : i % 40 + size]) for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_path() -> str:
    from deepinfer_core.models.sources import smollm2_gguf

    return str(smollm2_gguf())


def start_server(engine: str, threads: int, max_seqs: int, context: int) -> tuple[subprocess.Popen, str, int | None]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if engine == "deepinfer":
        cmd = [
            sys.executable,
            "-m",
            "deepinfer_core.entrypoints",
            "serve",
            "--port",
            str(port),
            "--max-num-seqs",
            str(max_seqs),
            "--max-model-len",
            str(context),
            "--max-queue",
            "256",
            "--log-level",
            "warning",
        ]
        eos = None
    else:
        cmd = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            gguf_path(),
            "--port",
            str(port),
            "--n_threads",
            str(threads),
            "--n_ctx",
            str(context),
            "--model_alias",
            MODEL,
        ]
        eos = 2  # <|im_end|> / the GGUF's EOS id for SmolLM2
    import httpx  # before the server starts: a missing client must not leave a server behind

    log = tempfile.TemporaryFile("w+")  # not a pipe: llama.cpp logs enough to fill one and block
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{engine} server exited: {log.read()[-300:]!r}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    return proc, url, eos
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{engine} server did not start")
    except BaseException:  # whatever stops the wait (an interrupt too) stops the server
        proc.kill()
        proc.wait()
        raise


def one_request(client, prompt: str, new_tokens: int, eos: int | None) -> dict:
    extra = {"ignore_eos": True} if eos is None else {"logit_bias": {str(eos): -100}}
    start = time.perf_counter()
    stamps, tokens = [], 0
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True, extra_body=extra
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
            tokens += 1
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - start if stamps else float("nan"), "gaps": gaps, "chunks": tokens}


def load_level(url: str, eos: int | None, n: int, prompt_tokens: int, new_tokens: int, timeout: float) -> dict | str:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    one_request(client, "Warm up", 2, eos)
    texts = prompts(n, prompt_tokens)
    start = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda p: one_request(client, p, new_tokens, eos), texts))
    except Exception as exc:  # e.g. a server that stops answering under concurrent streams
        return f"failed: {type(exc).__name__}"
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    return {
        "tok_s": n * new_tokens / wall,
        "ttft_p50": pct(ttfts, 50),
        "ttft_p99": pct(ttfts, 99),
        "itl_p50": pct(gaps, 50),
        "itl_p99": pct(gaps, 99),
        "chunks": sum(r["chunks"] for r in results) / n,
    }


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


OFFLINE_WORKER = """
import json, sys, time
from deepinfer_core import LLM, SamplingParams
from benchmarks.serve.serve_load import prompts
args = json.loads(sys.argv[1])
llm = LLM(args["model"], max_num_seqs=args["max_seqs"], max_model_len=args["context"])
params = SamplingParams(temperature=0, max_tokens=args["new_tokens"], ignore_eos=True)
llm.generate(["Warm up"], SamplingParams(temperature=0, max_tokens=2))
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    texts = prompts(n, args["prompt_tokens"])
    start = time.perf_counter()
    llm.generate(texts, params, use_tqdm=False)
    print(json.dumps({"tok_s": n * args["new_tokens"] / (time.perf_counter() - start)}), flush=True)
"""


class Offline:
    """deepinfer's ``LLM.generate`` in a subprocess that measures one level per request."""

    def __init__(self, max_seqs: int, prompt_tokens: int, new_tokens: int, threads: int, context: int) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        }
        args = json.dumps(
            {
                "model": MODEL,
                "max_seqs": max_seqs,
                "context": context,
                "prompt_tokens": prompt_tokens,
                "new_tokens": new_tokens,
            }
        )
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OFFLINE_WORKER, args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        if self.proc.stdout.readline().strip() != "ready":
            self.log.seek(0)
            raise RuntimeError(self.log.read()[-500:])

    def level(self, n: int) -> dict:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--engines", default="deepinfer,llamacpp,offline")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=2, help="rounds per level, best kept (default: %(default)s)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON (benchmarks/bench_json.py)")
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a client waits for its stream (default: %(default)s)"
    )
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    engines = args.engines.split(",")
    context = 2 * (args.prompt_tokens + args.new_tokens) + 64
    rows: dict[str, dict[int, dict] | str] = {}
    load_before = os.getloadavg()
    runners: dict = {}
    procs: list = []
    for engine in engines:
        try:
            if engine == "offline":
                runners[engine] = Offline(max(levels), args.prompt_tokens, args.new_tokens, args.threads, context)
                procs.append(runners[engine])
            else:
                proc, url, eos = start_server(engine, args.threads, max(levels), context)
                procs.append(proc)
                runners[engine] = (url, eos)
            rows[engine] = {}
        except Exception as exc:  # report, and measure the others
            rows[engine] = f"unavailable: {exc}"
    try:
        for n in levels:
            for round_ in range(args.repeats):
                order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
                for engine in order:
                    if not isinstance(rows[engine], dict) or isinstance(rows[engine].get(n), str):
                        continue
                    if engine == "offline":
                        r = runners[engine].level(n)
                    else:
                        url, eos = runners[engine]
                        r = load_level(url, eos, n, args.prompt_tokens, args.new_tokens, args.timeout)
                    best = rows[engine].get(n)
                    if isinstance(r, str) or best is None or r["tok_s"] > best["tok_s"]:
                        rows[engine][n] = r
    finally:
        for proc in procs:
            if isinstance(proc, Offline):
                proc.close()
            else:
                proc.terminate()
                proc.wait(60)
    base = rows.pop("offline", {})
    base = {n: r["tok_s"] for n, r in base.items() if isinstance(r, dict)} if isinstance(base, dict) else base
    print(
        f"# serve_load: SmolLM2-135M-Instruct, {args.prompt_tokens} prompt / {args.new_tokens} new tokens, "
        f"{args.threads} threads, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print(f"# load average (1 min) before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(
        "| N | engine | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | out tok/s | vs llama.cpp server | vs "
        "offline LLM |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in levels:
        for engine, result in rows.items():
            if isinstance(result, str):
                print(f"| {n} | {engine} | {result} | | | | | | |")
                continue
            r = result.get(n, "not measured")
            if isinstance(r, str):
                print(f"| {n} | {engine} serve | {r} | | | | | | |")
                continue
            peer = rows.get("llamacpp")
            peer_n = peer.get(n) if isinstance(peer, dict) else None
            vs_peer = f"{r['tok_s'] / peer_n['tok_s']:.2f}x" if isinstance(peer_n, dict) else "-"
            vs_offline = f"{r['tok_s'] / base[n]:.2f}x" if isinstance(base, dict) and n in base else "-"
            print(
                f"| {n} | {engine} serve | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p99'] * 1e3:.0f} | "
                f"{r['itl_p50'] * 1e3:.1f} | "
                f"{r['itl_p99'] * 1e3:.1f} | {r['tok_s']:.1f} | {vs_peer} | {vs_offline} |"
            )
        if isinstance(base, dict) and n in base:
            print(f"| {n} | deepinfer offline LLM | | | | | {base[n]:.1f} | | 1.00x |")
        elif isinstance(base, str):
            print(f"| {n} | deepinfer offline LLM | {base} | | | | | | |")
    if args.json:
        write_json(args.json, levels, rows, base, args)
    return 0


def write_json(path: str, levels: list[int], rows: dict, base, args: argparse.Namespace) -> None:
    """Rows: concurrency, engine (deepinfer serve, llamacpp serve, offline LLM), tok_s and, for the
    servers, ttft_p50_ms / ttft_p99_ms / itl_p50_ms / itl_p99_ms measured by the clients."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench_json

    out = []
    for n in levels:
        for engine, result in rows.items():
            r = result.get(n) if isinstance(result, dict) else None
            if isinstance(r, dict):
                out.append(
                    {
                        "concurrency": n,
                        "engine": engine,
                        "tok_s": r["tok_s"],
                        **{f"{k}_ms": 1e3 * r[k] for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")},
                    }
                )
        if isinstance(base, dict) and n in base:
            out.append({"concurrency": n, "engine": "offline", "tok_s": base[n]})
    bench_json.write(
        path,
        "serve_load",
        out,
        peer="llama.cpp's server (python -m llama_cpp.server) and deepinfer's offline LLM (same run)",
        notes=f"SmolLM2-135M-Instruct Q4_1, {args.prompt_tokens} prompt / {args.new_tokens} new tokens, "
        f"{args.threads} threads, best of {args.repeats}",
    )


if __name__ == "__main__":
    sys.exit(main())
