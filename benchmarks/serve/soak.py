"""Soak: N streaming clients (some hanging up mid-stream) against `deepinfer serve` for a long
time (an hour by default), reporting over time the server's RSS, its KV usage, requests done and
latency. The peer is the run's own first interval: a leak shows as RSS or idle KV usage that
keeps growing past it, a slowdown as latency ratios above 1.

    python benchmarks/serve/soak.py --minutes 60 --clients 8 --interval 60 --json benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer_core.entrypoints", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--max-num-seqs", str(args.clients), "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


class Load:
    def __init__(self, url: str, model: str, hang_up: float) -> None:
        self.url, self.model, self.hang_up = url, model, hang_up
        self.lock = threading.Lock()
        self.window: list[tuple[float, float]] = []  # (ttft s, e2e s) of completed requests
        self.hung_up = self.errors = 0
        self.stop = threading.Event()

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=300) as http:
            while not self.stop.is_set():
                body = {
                    "model": self.model,
                    "prompt": f"Note {rng.randrange(10**6)}: list some fruits:",
                    "max_tokens": rng.randint(8, 64),
                    "temperature": 0.7,
                    "stream": True,
                }
                cut = rng.randint(1, 6) if rng.random() < self.hang_up else None
                start, first, frames = time.monotonic(), None, 0
                try:
                    with http.stream("POST", f"{self.url}/v1/completions", json=body) as reply:
                        if reply.status_code != 200:
                            raise RuntimeError(reply.status_code)
                        for line in reply.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                first = first or time.monotonic()
                                frames += 1
                                if cut is not None and frames >= cut:
                                    break
                    with self.lock:
                        if cut is not None and frames >= cut:
                            self.hung_up += 1
                        else:
                            self.window.append((first - start, time.monotonic() - start))
                except Exception:
                    with self.lock:
                        self.errors += 1

    def take(self) -> tuple[list[tuple[float, float]], int, int]:
        with self.lock:
            window, self.window = self.window, []
            counts = (self.hung_up, self.errors)
            self.hung_up = self.errors = 0
        return window, *counts


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values[0] if values else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--interval", type=float, default=60, help="seconds per row")
    ap.add_argument("--hang-up", type=float, default=0.3, help="fraction of streams the client abandons")
    ap.add_argument("--json", help="write the rows (bench_json-style) here")
    args = ap.parse_args()
    proc, url = start_server(args)
    server = psutil.Process(proc.pid)
    load = Load(url, args.model, args.hang_up)
    threads = [threading.Thread(target=load.client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    rows, end = [], time.monotonic() + args.minutes * 60
    try:
        while time.monotonic() < end:
            time.sleep(args.interval)
            window, hung_up, errors = load.take()
            health = httpx.get(f"{url}/health", timeout=30).json()
            ttft, e2e = [w[0] for w in window], [w[1] for w in window]
            rows.append(
                {
                    "minute": round((args.minutes * 60 - (end - time.monotonic())) / 60, 1),
                    "rss_mib": round(server.memory_info().rss / 2**20, 1),
                    "kv_usage": round(health["kv_usage"], 3),
                    "completed": len(window),
                    "hung_up": hung_up,
                    "errors": errors,
                    "ttft_p50_ms": round(p(ttft, 50) * 1e3, 1),
                    "e2e_p50_ms": round(p(e2e, 50) * 1e3, 1),
                    "e2e_p95_ms": round(p(e2e, 95) * 1e3, 1),
                }
            )
            base = rows[0]
            rows[-1]["rss_vs_first"] = round(rows[-1]["rss_mib"] / base["rss_mib"], 3)
            rows[-1]["e2e_p50_vs_first"] = round(rows[-1]["e2e_p50_ms"] / max(base["e2e_p50_ms"], 1e-9), 2)
            print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    finally:
        load.stop.set()
        for t in threads:
            t.join(300)
        time.sleep(1)
        idle = httpx.get(f"{url}/health", timeout=30).json()
        proc.terminate()
        proc.wait(60)
    print("\n| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in rows[0]) + " |")
    print(f"\nidle after the load: kv_usage={idle['kv_usage']} running={idle['running']} waiting={idle['waiting']}")
    if args.json:
        result = {
            "benchmark": "soak",
            "script": "benchmarks/serve/soak.py",
            "command": " ".join(["python", "benchmarks/serve/soak.py", *sys.argv[1:]]),
            "machine": os.environ.get("BENCH_MACHINE", "unnamed"),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": os.environ.get("BENCH_COMMIT", "working tree"),
            "peer": "the run's first interval (ratios *_vs_first)",
            "rows": rows,
            "notes": f"idle after the load: kv_usage={idle['kv_usage']}, running={idle['running']}",
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
