"""The cluster's prefill router and autoscaler on a simulated clock, past the replicas this
machine can start: the same code ``deepinfer cluster`` runs (deepinfer_core/cluster/router.py,
autoscaler.py), driven by a per-replica cost model over an agent trace with DeepSeek's shape.

Trace: agent sessions (mean prompt ~77K tokens; every turn resends the whole history plus
~2% new tokens, so ~98% of a prompt was seen before); each session starts from one of a few
shared system prompts. Cost model per prefill replica (``--cost-model``): ``deepseek`` (the
default), DeepSeek's published per-card figures (REFERENCE.md section 1): compute 60K uncached
tokens/s, blocks read from the shared store 1.5M tokens/s; or fitted from this engine's own
measurement, a ``kv_cache.json`` results file (benchmarks/results/, ``kv/kv_cache.py``): compute
= prompt tokens / TTFT on a miss, store reads = cached tokens / (TTFT on a hit - its uncached
tokens' compute). Either way blocks in the replica's own cache are free, 5 ms a job, each
replica caches a fixed number of blocks (LRU), everything is in the store. Times scale with the
model; the ratios (and the policies' ranking) are what carry over.

Peers, same trace, same cost model: round-robin, least-loaded (fewest queued uncached tokens).

    offline   every request queued at t=0 in trace order: throughput as a fraction of a
              perfect-balance schedule (the ideal work, every re-sent block a local hit,
              spread evenly over the replicas)
    online    Poisson arrivals at ~70% of the ideal capacity: TTFT p50 / p99, local hit rate
    day       a diurnal day (the trace's span, load swinging 0.2x-1.8x), replicas under the autoscaler:
              replicas used (mean, max) and TTFT p99 vs a fixed fleet of max replicas

    python benchmarks/cluster/cluster_sim.py --replicas 8,64 --json benchmarks/results/cluster_sim.json
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import math
import random
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepinfer_core.cluster.autoscaler import Autoscaler, ScalingConfig  # noqa: E402
from deepinfer_core.cluster.router import PrefixIndex, ReplicaLoad, RouterConfig, route_prefill  # noqa: E402

BLOCK = 1024  # tokens per simulated block (the engine's are 128: coarser here, for speed)
COMPUTE_TPS = 60_000.0
LOAD_TPS = 1_500_000.0
JOB_S = 0.005
CACHE_BLOCKS = 2_000  # ~2M tokens per replica's own cache


def fit_cost(path: str) -> tuple[float, float, str]:
    """(compute tokens/s, store-read tokens/s, where from) of the first row of a kv_cache.json
    results file with a miss and a hit TTFT and the hit's share."""
    data = json.loads(Path(path).read_text())
    for row in data.get("rows", []):
        if row.get("miss_ttft_s") and row.get("hit_ttft_s") and row.get("hit_percent"):
            n = float(row["prompt_tokens"])
            compute = n / row["miss_ttft_s"]
            cached = n * row["hit_percent"] / 100
            load_s = row["hit_ttft_s"] - (n - cached) / compute
            if load_s <= 0:
                raise SystemExit(
                    f"{path}: the hit's TTFT is below its uncached tokens' compute; cannot fit store reads"
                )
            return compute, cached / load_s, f"{row.get('model')}, {int(n)} tokens, {row.get('date', '?')}"
    raise SystemExit(f"{path}: no row with miss_ttft_s, hit_ttft_s and hit_percent")


def make_trace(sessions: int, turns: int, seed: int) -> list[list[bytes]]:
    """Requests in arrival order, each its prompt's block keys (a chain: equal prefixes, equal keys)."""
    rng = random.Random(seed)
    systems = [[struct.pack("<II", 1 << 31 | g, i) for i in range(rng.randint(4, 12))] for g in range(8)]

    def new_session(s: int) -> list:
        start = max(8, int(rng.gauss(48, 12)))  # blocks of context at the first turn
        return [s, rng.randrange(8), start, rng.randint(turns // 2, turns)]

    concurrent = max(1, sessions // 4)  # sessions live at once; a finished one is replaced
    live = [new_session(s) for s in range(concurrent)]
    started = concurrent
    trace = []
    while live:
        i = rng.randrange(len(live))
        s, g, n, left = live[i]
        system = systems[g]
        trace.append(system + [struct.pack("<II", s, len(system) + k) for k in range(n)])
        live[i][2] += max(1, int(rng.expovariate(1 / 1.6)))  # ~1.6K new tokens a turn (~2%)
        live[i][3] -= 1
        if live[i][3] == 0:
            live.pop(i)
            if started < sessions:
                live.append(new_session(started))
                started += 1
    return trace


class Replica:
    def __init__(self, name: str, fleet: "Fleet") -> None:
        self.name, self.fleet = name, fleet
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.busy_until = 0.0
        self.queue: collections.deque = collections.deque()  # (finish, uncached tokens)
        self.queued_tokens = 0
        self.published = ReplicaLoad(name, "prefill")  # what the router sees (its held blocks: the index)

    def expire(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            self.queued_tokens -= self.queue.popleft()[1]
        self.published = ReplicaLoad(self.name, "prefill", waiting_tokens=self.queued_tokens)

    def run(self, keys: list[bytes], now: float, store: set) -> tuple[float, int]:
        """Queue a job; returns (finish time, blocks hit in this replica's own cache)."""
        hit = 0
        for key in keys[:-1]:  # the last block holds the token whose logits are computed
            if key not in self.cache:
                break
            hit += 1
        rest = keys[hit:]
        fresh = sum(1 for k in rest if k not in store)  # never computed anywhere: compute
        loaded = len(rest) - fresh  # in the shared store: read
        service = JOB_S + loaded * BLOCK / LOAD_TPS + max(1, fresh) * BLOCK / COMPUTE_TPS
        store.update(keys)
        index = self.fleet.index
        for key in keys:  # the simulated keys are 8 bytes: each is its own digest
            if index is not None and key not in self.cache:
                index.add(self.name, key)
            self.cache[key] = None
            self.cache.move_to_end(key)
        while len(self.cache) > CACHE_BLOCKS:
            evicted = self.cache.popitem(last=False)[0]
            if index is not None:
                index.discard(self.name, evicted)
        start = max(now, self.busy_until)
        self.busy_until = start + service
        uncached = len(rest) * BLOCK
        self.queue.append((self.busy_until, uncached))
        self.queued_tokens += uncached
        self.published = ReplicaLoad(self.name, "prefill", waiting_tokens=self.queued_tokens)
        self.fleet.finishing(self.busy_until, self)
        return self.busy_until, hit


class Fleet:
    """The replicas, the router's prefix index over their caches and their loads as of the clock
    (a heap of job finishes: each request updates only the replicas whose jobs ended, so the
    router's inputs cost nothing per replica and 1,000 replicas simulate in minutes)."""

    def __init__(self, n: int, indexed: bool = True) -> None:
        self.index = PrefixIndex() if indexed else None  # only deepinfer's router reads it
        self.replicas = [Replica(f"p{i:04d}", self) for i in range(n)]
        self.by_name = {r.name: r for r in self.replicas}
        self._finishes: list = []

    def finishing(self, at: float, replica: Replica) -> None:
        heapq.heappush(self._finishes, (at, replica.name))

    def advance(self, now: float) -> None:
        while self._finishes and self._finishes[0][0] <= now:
            self.by_name[heapq.heappop(self._finishes)[1]].expire(now)


def ideal_service(keys, seen: set) -> float:
    """Every block seen before is a local hit: the perfect-balance schedule's work."""
    fresh = sum(1 for k in keys if k not in seen)
    seen.update(keys)
    return JOB_S + max(1, fresh) * BLOCK / COMPUTE_TPS


class Policy:
    def __init__(self, kind: str, config: RouterConfig) -> None:
        self.kind, self.config, self.next = kind, config, 0

    def pick(self, fleet: Fleet, active: int, keys, now: float) -> Replica:
        replicas = fleet.replicas[:active]
        if self.kind == "round-robin":
            self.next += 1
            return replicas[self.next % len(replicas)]
        fleet.advance(now)
        if self.kind == "least-loaded":
            return min(replicas, key=lambda r: r.queued_tokens)
        loads = [r.published for r in replicas]
        decision = route_prefill(keys, len(keys) * BLOCK, loads, self.config, fleet.index)
        return fleet.by_name[decision.replica]


def simulate(trace, n: int, kind: str, arrivals: list[float], config: RouterConfig) -> dict:
    fleet = Fleet(n, indexed=kind == "deepinfer")
    policy = Policy(kind, config)
    ttft, hits, blocks, store = [], 0, 0, set()
    for keys, at in zip(trace, arrivals):
        replica = policy.pick(fleet, n, keys, at)
        finish, hit = replica.run(keys, at, store)
        ttft.append(finish - at)
        hits += hit
        blocks += len(keys)
    ttft.sort()
    return {
        "makespan_s": max(r.busy_until for r in fleet.replicas),
        "hit_rate": hits / blocks,
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[int(len(ttft) * 0.99)],
    }


def day(trace, max_replicas, load, ideal_total, config: RouterConfig, scale: bool, target: float = 1.0):
    """Diurnal arrivals (trough 20% of peak, the trace spans one "day"); the autoscaler picks
    how many replicas take work."""
    rng = random.Random(7)
    mean_rate = load * max_replicas * len(trace) / ideal_total  # requests/s at `load` of the full fleet
    day_s = len(trace) / mean_rate
    quota = math.ceil(1.25 * max_replicas) if scale else max_replicas  # the fleet may grow past the fixed one
    fleet = Fleet(quota)
    policy = Policy("deepinfer", config)
    scaler = Autoscaler(
        ScalingConfig(
            min_replicas=max(1, max_replicas // 8),
            max_replicas=quota,
            target_per_replica=target,
            spare=1,
            up_delay_s=day_s / 2000,
            down_delay_s=day_s / 100,
            up_interval_s=day_s / 1000,
            down_interval_s=day_s / 200,
            max_step_up=max(1, max_replicas // 8),
            max_step_down=max(1, max_replicas // 16),
        )  # fmt: skip
    )
    active = max_replicas if not scale else max(1, max_replicas // 4)
    tick, next_tick, now = day_s / 2000, 0.0, 0.0
    used, ttft, store = [], [], set()
    for keys in trace:
        phase = math.sin(2 * math.pi * now / day_s)
        rate = mean_rate * (1 + 0.8 * phase)
        now += rng.expovariate(max(rate, 1e-9))
        while scale and next_tick <= now:
            fleet.advance(next_tick)
            waiting = sum(r.queued_tokens for r in fleet.replicas[:active])
            active = scaler.decide(next_tick, active, waiting).replicas
            used.append(active)
            next_tick += tick
        replica = policy.pick(fleet, active, keys, now)
        finish, _ = replica.run(keys, now, store)
        ttft.append(finish - now)
        if now > day_s:
            break
    ttft.sort()
    return {
        "replicas_mean": sum(used) / len(used) if used else max_replicas,
        "replicas_max": max(used) if used else max_replicas,
        "ttft_p99_s": ttft[int(len(ttft) * 0.99)],
        "requests": len(ttft),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="8,64")
    p.add_argument("--sessions-per-replica", type=int, default=40)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--load", type=float, default=0.5, help="online arrival rate as a fraction of ideal capacity")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--imbalance-tokens", type=int, default=65536, help="the router's imbalance_abs")
    p.add_argument(
        "--scale-target-s",
        type=float,
        default=1.0,
        help="the autoscaler's target: seconds of queued compute per replica",
    )
    p.add_argument(
        "--cost-model", default="deepseek", help="deepseek (published per-card figures) or a kv_cache.json to fit from"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    global COMPUTE_TPS, LOAD_TPS
    if args.cost_model != "deepseek":
        COMPUTE_TPS, LOAD_TPS, source = fit_cost(args.cost_model)
        print(f"cost model fitted from {args.cost_model} ({source}): compute {COMPUTE_TPS:,.0f} tok/s, "
              f"store reads {LOAD_TPS:,.0f} tok/s ({LOAD_TPS / COMPUTE_TPS:.0f}x)")  # fmt: skip
    config = RouterConfig(block_size=BLOCK, imbalance_abs=args.imbalance_tokens, imbalance_ratio=1.5)
    rows = []
    started = time.time()
    for n in (int(x) for x in args.replicas.split(",")):
        trace = make_trace(n * args.sessions_per_replica, args.turns, args.seed)
        seen: set = set()
        ideal_total = sum(ideal_service(k, seen) for k in trace)
        perfect = ideal_total / n
        rng = random.Random(args.seed)
        t, online = 0.0, []
        for _ in trace:
            t += rng.expovariate(args.load * n / (ideal_total / len(trace)))
            online.append(t)
        for kind in ("deepinfer", "round-robin", "least-loaded"):
            off = simulate(trace, n, kind, [0.0] * len(trace), config)
            on = simulate(trace, n, kind, online, config)
            rows.append({
                "replicas": n, "policy": kind, "requests": len(trace), "cost_model": args.cost_model,
                "offline_vs_perfect": round(perfect / off["makespan_s"], 3),
                "hit_rate": round(on["hit_rate"], 3),
                "ttft_p50_s": round(on["ttft_p50_s"], 3), "ttft_p99_s": round(on["ttft_p99_s"], 3),
            })  # fmt: skip
        fixed = day(trace, n, args.load, ideal_total, config, scale=False)
        scaled = day(trace, n, args.load, ideal_total, config, scale=True, target=args.scale_target_s * COMPUTE_TPS)
        rows.append({
            "replicas": n, "policy": "deepinfer + autoscaler (day)", "requests": scaled["requests"],
            "replicas_mean": round(scaled["replicas_mean"], 1), "replicas_max": scaled["replicas_max"],
            "ttft_p99_s": round(scaled["ttft_p99_s"], 3), "fixed_fleet_ttft_p99_s": round(fixed["ttft_p99_s"], 3),
        })  # fmt: skip
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import bench_json

        cost = (
            "DeepSeek's published per-card figures"
            if args.cost_model == "deepseek"
            else f"fitted from {args.cost_model}: {COMPUTE_TPS:,.0f} uncached tok/s, {LOAD_TPS:,.0f} tok/s from store"
        )
        bench_json.write(
            args.json, "cluster_sim", rows,
            peer="round-robin and least-loaded routing on the same trace and cost model; a perfect-balance offline "
            "schedule; a fixed fleet of N replicas (autoscaler day)",
            notes=f"simulated clock; cost model: {cost}. offline_vs_perfect: ideal work (every re-sent block a local "
            "hit) spread evenly / makespan with all requests queued at t=0. hit_rate: prompt blocks found in the "
            "chosen replica's own cache. TTFT: prefill only, Poisson arrivals at --load of ideal capacity. Day: load "
            f"0.2x-1.8x, autoscaler target {args.scale_target_s} s of queued compute per replica, quota 1.25 N; "
            f"{args.sessions_per_replica} sessions per replica",
        )  # fmt: skip


if __name__ == "__main__":
    main()
