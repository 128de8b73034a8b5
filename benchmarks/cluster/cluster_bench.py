"""``deepinfer cluster`` (1 prefill + 2 decode replicas, real processes on this machine) against one
``deepinfer serve`` (the peer, same run), on multi-turn agent conversations.

Each of N concurrent clients (the ``openai`` SDK, one thread each, streaming, greedy) holds one
conversation: a shared agent system prompt, a task, then ``--turns`` turns, each resending the
whole history plus a short new user message and asking for ``--new-tokens`` tokens (EOS ignored,
so every turn is the same work). Per setup and N: output tokens per second of the whole level
(wall clock), time to first token p50 / p99 over every turn (client side), the prompt-cache hit
rate (``usage.prompt_tokens_details.cached_tokens`` / ``usage.prompt_tokens``), and how many
conversations have every turn's greedy text equal to the single serve's. The cluster hands
prompts to decode through a ``local://`` KV store in a temporary directory.

A last cluster phase runs fresh conversations at the largest N and ``kill -9``s one decode
replica mid-stream (its Ray Serve replica process, found by its process title among this run's
own processes): the clients must see no error and the same texts; the ingress's
``decode_retries`` (``GET /cluster``) counts the streams it continued on another replica.

The setups run one after the other (the serve first, then the cluster) so that neither's idle
processes share the cores with the other's measurement. Servers are subprocesses in sessions of
their own, torn down on every exit (SIGTERM to the session, then SIGKILL); no ``ray stop``, which
would stop any other Ray on the machine. Progress on stderr, the table on stdout.

    python benchmarks/cluster/cluster_bench.py --clients 1,4 --turns 4 --new-tokens 32
    python benchmarks/cluster/cluster_bench.py --clients 1,2 --turns 3 --new-tokens 16 \\
        --json benchmarks/results/cluster_bench.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

MODEL = "smollm2-135m-instruct"
SYSTEM = (
    "You are a careful software agent working in a Python repository. You can call these tools: "
    "read_file(path) returns a file's text; list_dir(path) lists a folder; run_tests(pattern) runs the "
    "test suite and returns failures; search(query) finds code by meaning; edit_file(path, old, new) "
    "replaces text in a file; git_diff() shows your changes. Work in small steps. Before every edit, "
    "read the file. After every edit, run the tests that cover it. Explain each step in one or two "
    "sentences, then name the tool you call and its arguments. Never invent file contents; never edit "
    "files you have not read. When the task is done, summarise what changed and why, and list the tests "
    "you ran with their results. Keep answers short: the user reads them in a terminal."
)
TASKS = [
    "The function parse_date in utils/dates.py fails on ISO dates with a timezone. Fix it.",
    "Add a --verbose flag to the command line in cli/main.py that prints each step.",
    "The cache in storage/lru.py never evicts. Find out why and fix it.",
    "Rename the class UserRecord to Account everywhere in the models package.",
    "Write a test for the retry loop in net/client.py when the server closes the connection.",
    "The report in reports/monthly.py sums the wrong column. Find the bug.",
    "Make the logger in app/log.py write JSON lines instead of plain text.",
    "Remove the deprecated function old_connect from db/pool.py and its callers.",
]
FOLLOW_UPS = [
    "The tool returned: 3 tests failed with AttributeError. What next?",
    "Done. The file now reads as you expected. Continue.",
    "The test run printed: all passed. Anything else to check?",
    "Show me the exact edit you would make.",
    "Why that approach and not a simpler one?",
]


# -- the servers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Server:
    """A ``deepinfer serve`` / ``deepinfer cluster`` subprocess in a session of its own."""

    def __init__(self, command: str, extra: list[str], threads: int, timeout: float) -> None:
        self.command, self.port = command, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"deepinfer-{command}-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "deepinfer_core.entrypoints", command, "--port", str(self.port), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DEEPINFER_LOG_LEVEL": "warning"}
        progress(f"starting {command} (log {self.log.name}): {' '.join(cmd[3:])}")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop(keep_log=True)
            raise

    def _wait_healthy(self, timeout: float) -> None:
        command = self.command
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{command} exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        progress(f"{command} is up on {self.url}")
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{command} did not answer /health within {timeout:.0f} s: {self.tail()}")

    def tail(self, chars: int = 600) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-chars:]

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process in this server's session: Ray's too."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    session = int(f.read().rsplit(")", 1)[1].split()[3])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError, IndexError):
                continue
            if session == self.proc.pid:
                found.append((int(entry), cmdline))
        return found

    def stop(self, keep_log: bool = False) -> None:
        progress(f"stopping {self.command}" + (f" (its log stays: {self.log.name})" if keep_log else ""))
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            pass
        for pid, _ in self.processes():  # what outlived the command (Ray's own processes)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()
        if not keep_log:
            os.unlink(self.log.name)


def engine_flags(args) -> list[str]:
    return [
        "--model", MODEL, "--device", "cpu", "--max-num-seqs", str(max(args.clients)),
        "--kv-cache-blocks", str(args.kv_blocks), "--max-model-len", "4096",
        *(["--batch-invariant"] if args.batch_invariant else []),
    ]  # fmt: skip


# -- the clients ---------------------------------------------------------------------------------
def conversation(client, index: int, turns: int, new_tokens: int, on_token=None) -> dict:
    """One agent conversation, turn after turn; the error (if any) ends it."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[index % len(TASKS)]}]
    out = {"texts": [], "ttft": [], "completion": 0, "prompt": 0, "cached": 0, "error": None}
    for turn in range(turns):
        start = time.perf_counter()
        first, pieces, usage = None, [], None
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=new_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter() - start
                    pieces.append(chunk.choices[0].delta.content)
                    if on_token is not None:
                        on_token(turn, len(pieces))
        except Exception as exc:  # counted, not raised: the other clients go on
            out["error"] = f"turn {turn}: {type(exc).__name__}: {exc}"
            return out
        text = "".join(pieces)
        out["texts"].append(text)
        out["ttft"].append(first if first is not None else float("nan"))
        if usage is not None:
            out["completion"] += usage.completion_tokens
            out["prompt"] += usage.prompt_tokens
            details = usage.prompt_tokens_details
            out["cached"] += (details.cached_tokens or 0) if details is not None else 0
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": FOLLOW_UPS[(index + turn) % len(FOLLOW_UPS)]},
        ]
    return out


def run_level(url: str, indexes: list[int], args, on_token=None) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.timeout)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(indexes)) as pool:
        convs = list(pool.map(lambda i: conversation(client, i, args.turns, args.new_tokens, on_token), indexes))
    wall = time.perf_counter() - start
    ttfts = sorted(t for c in convs for t in c["ttft"])
    prompt = sum(c["prompt"] for c in convs)
    return {
        "wall_s": wall,
        "tok_s": sum(c["completion"] for c in convs) / wall,
        "ttft_p50_ms": pct(ttfts, 50) * 1e3,
        "ttft_p99_ms": pct(ttfts, 99) * 1e3,
        "hit_rate": sum(c["cached"] for c in convs) / prompt if prompt else float("nan"),
        "errors": sum(c["error"] is not None for c in convs),
        "error_texts": [c["error"] for c in convs if c["error"]],
        "texts": [c["texts"] for c in convs],
    }


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def warm_up(url: str, n: int) -> None:
    """A short request per client slot, so that every replica has served before the clock starts."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": "Say hello."}]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda _: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4), range(n)))


def cluster_view(url: str) -> dict:
    with urllib.request.urlopen(url + "/cluster", timeout=30) as r:
        return json.loads(r.read())


def kill_decode_replica(server: Server) -> str | None:
    """SIGKILL the busiest decode replica of ``server`` (Ray Serve titles its processes
    ``ray::ServeReplica:<app>:<deployment>``; the busiest used the most CPU time in the last
    0.3 s: it is computing streams); a description, or None if there was none."""
    replicas = [(pid, cmd) for pid, cmd in server.processes() if "ServeReplica:deepinfer:decode" in cmd]
    if not replicas:
        return None
    before = {pid: cpu_ticks(pid) for pid, _ in replicas}
    time.sleep(0.3)
    busy = {pid: cpu_ticks(pid) - before[pid] for pid, _ in replicas}
    pid = max(busy, key=busy.get)
    os.kill(pid, signal.SIGKILL)
    return f"pid {pid} of {len(replicas)} decode replicas (CPU ticks in 0.3 s: {sorted(busy.values())})"


def cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return 0


# -- the run -------------------------------------------------------------------------------------
def conversation_sets(levels: list[int]) -> tuple[dict[int, list[int]], list[int]]:
    """Distinct conversations for each level and for the kill phase (no level starts warm from
    another's prompts)."""
    sets, nxt = {}, 0
    for n in levels:
        sets[n] = list(range(nxt, nxt + n))
        nxt += n
    return sets, list(range(nxt, nxt + max(levels)))


def measure_serve(args, sets, kill_set) -> tuple[dict, list]:
    server = Server("serve", engine_flags(args) + ["--log-level", "warning"], args.serve_threads, args.start_timeout)
    try:
        warm_up(server.url, max(args.clients))
        rows = {}
        for n, indexes in sets.items():
            progress(f"serve: {n} client(s), {args.turns} turns x {args.new_tokens} tokens")
            rows[n] = run_level(server.url, indexes, args)
        progress("serve: the kill phase's conversations (reference texts)")
        reference = run_level(server.url, kill_set, args)
        return rows, reference
    finally:
        server.stop(keep_log=sys.exc_info()[0] is not None)


def measure_cluster(args, sets, kill_set, store: str) -> tuple[dict, dict | None]:
    extra = engine_flags(args) + ["--prefill", "1", "--decode", "2", "--kv-store", f"local://{store}"]
    server = Server("cluster", extra, args.replica_threads, args.start_timeout)
    clean = False  # no exception, no client error: the log goes
    try:
        warm_up(server.url, 2 * max(args.clients))
        rows = {}
        for n, indexes in sets.items():
            progress(f"cluster: {n} client(s), {args.turns} turns x {args.new_tokens} tokens")
            rows[n] = run_level(server.url, indexes, args)
        jobs = {r["name"]: r["decode_jobs"] for r in cluster_view(server.url)["replicas"] if r["role"] == "decode"}
        progress(f"cluster: decode jobs per decode replica so far: {sorted(jobs.values())}")
        rows[max(sets)]["decode_jobs"] = sorted(jobs.values())
        if not args.kill:
            clean = not any(r["errors"] for r in rows.values())
            return rows, None
        retries_before = cluster_view(server.url)["ingress"]["decode_retries"]
        killed: list = []
        lock = threading.Lock()

        def on_token(turn: int, tokens: int) -> None:  # mid-stream of the second turn
            if turn == min(1, args.turns - 1) and tokens == max(1, args.new_tokens // 4):
                with lock:
                    if not killed:
                        killed.append(kill_decode_replica(server))
                        progress(f"cluster: killed decode replica {killed[0]}")

        progress(f"cluster: kill phase, {len(kill_set)} client(s)")
        kill = run_level(server.url, kill_set, args, on_token)
        kill["killed"] = killed[0] if killed else None
        kill["decode_retries"] = cluster_view(server.url)["ingress"]["decode_retries"] - retries_before
        clean = not any(r["errors"] for r in [*rows.values(), kill])
        return rows, kill
    finally:
        server.stop(keep_log=not clean)


def row(n: int, setup: str, r: dict, serve: dict, equal: int | None) -> dict:
    """One table row; ``equal``: conversations whose every turn's text is the serve's."""
    return {
        "clients": n, "setup": setup, "tok_s": r["tok_s"], "ttft_p50_ms": r["ttft_p50_ms"],
        "ttft_p99_ms": r["ttft_p99_ms"], "prompt_cache_hit_rate": r["hit_rate"], "errors": r["errors"],
        "texts_equal": equal, "tok_s_vs_serve": r["tok_s"] / serve["tok_s"] if serve["tok_s"] else float("nan"),
        "ttft_p50_vs_serve": r["ttft_p50_ms"] / serve["ttft_p50_ms"] if serve["ttft_p50_ms"] else float("nan"),
    }  # fmt: skip


def print_table(rows: list[dict]) -> None:
    print(
        "| N | setup | out tok/s | TTFT p50 ms | TTFT p99 ms | prompt cache hit | texts = serve | errors "
        "| decode retries | tok/s vs serve | TTFT p50 vs serve |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        same = "-" if r["texts_equal"] is None else f"{r['texts_equal']}/{r['clients']}"
        print(
            f"| {r['clients']} | {r['setup']} | {fmt(r['tok_s'], 1)} | {fmt(r['ttft_p50_ms'])} "
            f"| {fmt(r['ttft_p99_ms'])} | {fmt(100 * r['prompt_cache_hit_rate'], 1)}% | {same} | {r['errors']} "
            f"| {r.get('decode_retries', '-')} | {fmt(r['tok_s_vs_serve'], 2)}x | {fmt(r['ttft_p50_vs_serve'], 2)}x |"
        )


def equal_conversations(a: dict, b: dict) -> int:
    return sum(x == y for x, y in zip(a["texts"], b["texts"]))


def fmt(value: float, digits: int = 0) -> str:
    return "-" if value != value else f"{value:,.{digits}f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,4", help="concurrent conversations per level (default: %(default)s)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens each turn asks for (default: %(default)s)")
    p.add_argument("--kv-blocks", type=int, default=96, help="KV blocks of each engine (default: %(default)s)")
    p.add_argument(
        "--serve-threads", type=int, default=os.cpu_count(), help="the serve's threads (default: %(default)s)"
    )
    p.add_argument(
        "--replica-threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) // 3),
        help="each cluster replica's threads: the 3 share the cores (default: %(default)s)",
    )
    p.add_argument(
        "--batch-invariant", action="store_true", help="engines with --batch-invariant (texts equal at any N)"
    )
    p.add_argument("--no-kill", dest="kill", action="store_false", help="skip the phase that kills a decode replica")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a client waits for a turn")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--json", metavar="PATH", help="also write the results (benchmarks/bench_json.py)")
    args = p.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    sets, kill_set = conversation_sets(args.clients)
    started, load_before = time.time(), os.getloadavg()
    serve_rows, reference = measure_serve(args, sets, kill_set)
    with tempfile.TemporaryDirectory(prefix="deepinfer-cluster-bench-kv-") as store:
        cluster_rows, kill = measure_cluster(args, sets, kill_set, store)

    print(
        f"# cluster_bench: SmolLM2-135M-Instruct (CPU, float32), {args.turns} turns x {args.new_tokens} tokens, "
        f"cluster 1 prefill + 2 decode ({args.replica_threads} thread(s) each) vs serve ({args.serve_threads}), "
        f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, load before {load_before[0]:.1f}, "
        f"after {os.getloadavg()[0]:.1f}, {time.time() - started:.0f} s"
    )
    rows = []
    for n in args.clients:
        s, c = serve_rows[n], cluster_rows[n]
        rows.append(row(n, "serve", s, s, None))
        rows.append(row(n, "cluster 1P+2D", c, s, equal_conversations(c, s)))
    if kill is not None:
        n = len(kill_set)
        killed = row(n, "cluster 1P+2D, a decode replica killed", kill, reference, equal_conversations(kill, reference))
        rows.append({**killed, "decode_retries": kill["decode_retries"], "killed": kill["killed"]})
    print_table(rows)
    print(f"# decode jobs per decode replica after the levels: {cluster_rows[max(args.clients)]['decode_jobs']}")
    if kill is not None:
        print(f"# killed: {kill['killed']}; its serve peer ran the same conversations")
    for r in [*serve_rows.values(), *cluster_rows.values(), *([kill] if kill else [])]:
        for e in r["error_texts"]:
            print(f"# error: {e}")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import bench_json

        bench_json.write(
            args.json, "cluster_bench", rows, peer="one deepinfer serve (same run, same engine options)",
            notes="real processes; the setups run one after the other; absolute numbers depend on the machine's load",
        )  # fmt: skip
    failed = kill is not None and (kill["errors"] or kill["killed"] is None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
