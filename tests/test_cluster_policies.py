"""The serving cluster's policies (deepinfer_core/cluster/router.py, autoscaler.py), without Ray.

The router's expectations are worked out by hand from the rules in the module docstring (tier
bounds, the SGLang-style imbalance test), the autoscaler runs on a simulated clock; the hash
chain the router matches on is checked against the engine's own KV cache manager.
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from deepinfer_core.cluster.autoscaler import Autoscaler, ScalingConfig
from deepinfer_core.cluster.router import (
    ReplicaLoad,
    RoutedLedger,
    RouterConfig,
    digest,
    route_decode,
    route_prefill,
    tier_members,
    tier_of,
)
from deepinfer_core.engine.kv_cache_manager import KVCacheManager, chain_keys
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.sampling_params import SamplingParams

BS = 4  # a small block size keeps the prompts short
SMALL_TIERS = RouterConfig(block_size=BS, tier_bounds=(16, 64, 256), imbalance_abs=64, imbalance_ratio=1.5)


def holding(keys, n):
    return frozenset(digest(k) for k in keys[:n])


# -- the hash chain -------------------------------------------------------------------------------
def test_chain_keys_are_the_engines_block_keys():
    tokens = list(range(1000, 1000 + 4 * 128 + 17))
    manager = KVCacheManager(num_blocks=8, block_size=128, namespace="model-x|layout|bs=128")
    req = Request("r", tokens, SamplingParams(), seed=0)
    manager.match_prefix(req)
    assert chain_keys(b"model-x|layout|bs=128", tokens, 128) == req.block_keys
    assert len(req.block_keys) == 4
    # independently: SHA-256 over namespace, parent key, the block's ids as uint32 LE
    first = hashlib.sha256(b"model-x|layout|bs=128" + struct.pack("<128I", *tokens[:128])).digest()
    assert req.block_keys[0] == first
    assert chain_keys(b"other-namespace", tokens, 128)[0] != first


# -- prefill: tiers -------------------------------------------------------------------------------
@pytest.mark.parametrize("uncached, tier", [(0, 0), (15, 0), (16, 1), (63, 1), (64, 2), (255, 2), (256, 3), (10**6, 3)])
def test_tier_bounds(uncached, tier):
    assert tier_of(uncached, (16, 64, 256)) == tier


def test_default_tiers_are_deepseeks():
    bounds = RouterConfig().tier_bounds
    assert [tier_of(n, bounds) for n in (16383, 16384, 65535, 65536, 262143, 262144)] == [0, 1, 1, 2, 2, 3]


def test_tier_members_split_replicas_in_name_order():
    names = [ReplicaLoad(f"p{i}") for i in (3, 0, 2, 1)]
    assert [[r.name for r in tier_members(names, t, 4)] for t in range(4)] == [["p0"], ["p1"], ["p2"], ["p3"]]
    two = [ReplicaLoad("a"), ReplicaLoad("b")]
    assert [tier_members(two, t, 4)[0].name for t in range(4)] == ["a", "a", "b", "b"]
    eight = [ReplicaLoad(f"r{i}") for i in range(8)]
    assert [r.name for r in tier_members(eight, 2, 4)] == ["r4", "r5"]


def test_prefill_goes_to_the_tier_of_its_uncached_length():
    replicas = [ReplicaLoad(f"p{i}", "prefill") for i in range(4)]
    for prompt, expected in ((9, "p0"), (40, "p1"), (100, "p2"), (400, "p3")):
        keys = chain_keys(b"ns", list(range(prompt)), BS)
        decision = route_prefill(keys, prompt, replicas, SMALL_TIERS)
        assert decision.replica == expected, (prompt, decision)
        assert decision.uncached_tokens == prompt and decision.cached_tokens == 0


def test_a_cached_prefix_moves_the_prompt_to_a_shorter_tier():
    tokens = list(range(100))  # 100 uncached: tier 2; with 96 cached somewhere, 4 uncached: tier 0
    keys = chain_keys(b"ns", tokens, BS)
    replicas = [ReplicaLoad("p0", prefix_keys=holding(keys, 24)), ReplicaLoad("p1"), ReplicaLoad("p2")]
    decision = route_prefill(keys, 100, replicas, SMALL_TIERS)
    assert (decision.replica, decision.tier, decision.cached_tokens) == ("p0", 0, 96)


# -- prefill: prefix affinity and the imbalance override ------------------------------------------
def test_longest_cached_prefix_wins_within_a_tier():
    tokens = list(range(60))  # 15 blocks; tier 0 needs < 16 uncached
    keys = chain_keys(b"ns", tokens, BS)
    config = RouterConfig(block_size=BS, tier_bounds=(), imbalance_abs=64)  # one tier: every replica
    replicas = [
        ReplicaLoad("a", prefix_keys=holding(keys, 3), waiting_tokens=0),
        ReplicaLoad("b", prefix_keys=holding(keys, 10), waiting_tokens=40),
        ReplicaLoad("c", waiting_tokens=0),
    ]
    decision = route_prefill(keys, 60, replicas, config)
    assert (decision.replica, decision.reason, decision.cached_tokens) == ("b", "longest cached prefix", 40)
    assert decision.alternatives == {"a": 12, "b": 40, "c": 0}


def test_a_chain_matches_only_from_its_start():
    keys = chain_keys(b"ns", list(range(40)), BS)
    replicas = [ReplicaLoad("a", prefix_keys=frozenset(digest(k) for k in keys[1:])), ReplicaLoad("b")]
    config = RouterConfig(block_size=BS, tier_bounds=())
    decision = route_prefill(keys, 40, replicas, config)
    assert decision.cached_tokens == 0 and decision.reason == "least loaded"


def test_imbalance_override_sends_a_hot_prefix_to_the_least_loaded():
    keys = chain_keys(b"ns", list(range(60)), BS)
    config = RouterConfig(block_size=BS, tier_bounds=(), imbalance_abs=64, imbalance_ratio=1.5)
    hot = ReplicaLoad("hot", prefix_keys=holding(keys, 14), waiting_tokens=200)
    idle = ReplicaLoad("idle", waiting_tokens=10)
    decision = route_prefill(keys, 60, [hot, idle], config)
    assert (decision.replica, decision.reason) == ("idle", "imbalance override")
    # the same gap but not 1.5x (a busy pool): affinity holds
    decision = route_prefill(keys, 60, [hot, ReplicaLoad("busy", waiting_tokens=135)], config)
    assert decision.replica == "hot"
    # 1.5x but a small absolute gap: affinity holds
    decision = route_prefill(
        keys, 60, [ReplicaLoad("hot", prefix_keys=hot.prefix_keys, waiting_tokens=60), idle], config
    )
    assert decision.replica == "hot"


# -- the prefix index: the same decisions without scanning every replica's published set ----------
def _index_of(replicas):
    from deepinfer_core.cluster.router import PrefixIndex

    index = PrefixIndex()
    for r in replicas:
        index.publish(r.name, r.prefix_keys)
    return index


def test_the_index_makes_the_scans_decision_on_random_clusters():
    import random

    rng = random.Random(5)
    chains = [chain_keys(f"s{g}".encode(), list(range(80)), BS) for g in range(3)]
    config = RouterConfig(block_size=BS, tier_bounds=(16, 40, 64), imbalance_abs=24, imbalance_ratio=1.5)
    checked = overrides = hits = 0
    for case in range(400):
        replicas = []
        for i in range(rng.randint(1, 9)):
            held = set()
            for chain in chains:  # a leading run, sometimes with holes (an evicted early block)
                n = rng.choice([0, 0, 3, 8, 12, 20])
                held |= {digest(k) for k in chain[:n]}
                if n and rng.random() < 0.3:
                    held.discard(digest(chain[rng.randrange(n)]))
            replicas.append(
                ReplicaLoad(f"r{i}", "prefill", waiting_tokens=rng.choice([0, 5, 30, 90]), prefix_keys=frozenset(held))
            )
        keys = rng.choice(chains)[: rng.randint(1, 20)]
        prompt = len(keys) * BS + rng.randint(0, BS - 1)
        index = _index_of(replicas)
        index.publish("elsewhere", {digest(k) for k in keys})  # holds everything but is not a candidate
        scan, indexed = (
            route_prefill(keys, prompt, replicas, config),
            route_prefill(keys, prompt, replicas, config, index),
        )
        assert (indexed.replica, indexed.reason, indexed.tier, indexed.cached_tokens, indexed.uncached_tokens) == (
            scan.replica, scan.reason, scan.tier, scan.cached_tokens, scan.uncached_tokens
        ), case  # fmt: skip
        longest = max(scan.alternatives.values())
        assert indexed.alternatives == {n: c for n, c in scan.alternatives.items() if longest and c == longest}
        checked += 1
        overrides += scan.reason == "imbalance override"
        hits += scan.cached_tokens > 0
    assert checked == 400 and overrides > 10 and hits > 100  # the cases reach every branch


def test_the_index_follows_publications_as_diffs():
    from deepinfer_core.cluster.router import PrefixIndex

    keys = chain_keys(b"ns", list(range(40)), BS)
    index = PrefixIndex()
    index.publish("a", holding(keys, 6))
    index.publish("b", holding(keys, 3))
    assert index.longest(keys, 9, {"a", "b"}) == (6, {"a"})
    assert index.longest(keys, 2, {"a", "b"}) == (2, {"a", "b"})
    assert index.longest(keys, 9, {"b"}) == (3, {"b"})
    index.publish("a", holding(keys, 2))  # evicted down to 2 blocks
    assert index.longest(keys, 9, {"a", "b"}) == (3, {"b"})
    index.discard("b", digest(keys[0]))  # a hole at the start: no leading run
    assert index.longest(keys, 9, {"a", "b"}) == (2, {"a"}) and index.leading("b", keys, 9) == 0
    index.drop("a")
    assert index.longest(keys, 9, {"a", "b"}) == (0, set()) and "a" not in index
    assert index.held("b") == holding(keys, 3) - {digest(keys[0])}


def test_no_replica_is_an_error():
    with pytest.raises(ValueError, match="no prefill replica"):
        route_prefill([], 10, [], SMALL_TIERS)
    with pytest.raises(ValueError, match="tier bounds"):
        RouterConfig(tier_bounds=(64, 16, 256))


# -- decode placement -----------------------------------------------------------------------------
def test_decode_short_to_long_resident_caches_and_long_to_short():
    config = RouterConfig(block_size=BS, decode_slack=2)
    replicas = [
        ReplicaLoad("full", "decode", running=2, resident_blocks=80, num_blocks=100),
        ReplicaLoad("light", "decode", running=2, resident_blocks=8, num_blocks=100),
    ]  # 22 blocks per running request on average
    assert route_decode(20, 8, replicas, config).replica == "full"  # 7 blocks: short
    assert route_decode(120, 8, replicas, config).replica == "light"  # 32 blocks: long
    assert route_decode(60, 20, replicas, config).replica == "full"  # 20 blocks: short, and just fits
    # a short request that does not fit the long cache goes where it fits
    nearly_full = [ReplicaLoad("full", running=2, resident_blocks=97, num_blocks=100), replicas[1]]
    assert route_decode(8, 8, nearly_full, config).replica == "light"


def test_decode_keeps_running_counts_even():
    config = RouterConfig(block_size=BS, decode_slack=1)
    replicas = [
        ReplicaLoad("full", running=9, resident_blocks=90, num_blocks=1000),
        ReplicaLoad("light", running=1, resident_blocks=4, num_blocks=1000),
    ]
    # short, but "full" runs 8 more requests than "light": beyond the slack
    assert route_decode(4, 4, replicas, config).replica == "light"


def test_the_ledger_adds_what_a_stale_load_does_not_show_yet():
    ledger = RoutedLedger()
    load = ReplicaLoad("a", running=2, waiting_tokens=10, resident_blocks=5, num_blocks=100)
    ledger.record("a", 99.0, 300, 4)  # before the load was published: already in it
    ledger.record("a", 100.5, 200, 3)  # after: not yet
    ledger.record("b", 100.6, 50, 1)  # another replica's
    seen = ledger.adjust(load, at=100.0, now=101.0)
    assert (seen.running, seen.waiting_tokens, seen.resident_blocks) == (3, 210, 8)
    assert ledger.adjust(load, at=101.0, now=101.0) == load  # a fresh load shows everything
    # a load without a timestamp: the jobs of the last second
    assert ledger.adjust(load, at=None, now=101.2).running == 3
    assert ledger.adjust(load, at=None, now=105.0) == load


def test_jobs_arriving_together_spread_over_replicas_with_stale_loads():
    """Loads are published every few hundred ms: a burst sees the same figures for all its jobs.
    Without the ledger every job went to the replica that looked emptiest."""
    config = RouterConfig(block_size=BS)
    stale = [ReplicaLoad(f"d{i}", running=0, resident_blocks=0, num_blocks=1000) for i in range(2)]
    alone = [route_decode(40, 16, stale, config).replica for _ in range(6)]
    assert len(set(alone)) == 1  # the pile-up
    ledger, picks = RoutedLedger(), []
    for _ in range(6):
        loads = [ledger.adjust(r, at=100.0, now=100.2) for r in stale]
        decision = route_decode(40, 16, loads, config)
        ledger.record(decision.replica, 100.2, 40, -(-(40 + 16) // BS))
        picks.append(decision.replica)
    assert sorted(picks.count(name) for name in ("d0", "d1")) == [3, 3]


def test_decode_resident_kv_evens_out_over_a_stream():
    """Alternating long and short jobs on two replicas: resident KV ends within one long job."""
    config = RouterConfig(block_size=BS, decode_slack=4)
    state = {"a": [0, 0], "b": [0, 0]}  # running, resident blocks
    for i in range(40):
        prompt = 200 if i % 2 else 8
        replicas = [ReplicaLoad(n, running=r, resident_blocks=b, num_blocks=10**6) for n, (r, b) in state.items()]
        choice = route_decode(prompt, 0, replicas, config).replica
        state[choice][0] += 1
        state[choice][1] += prompt // BS
    assert abs(state["a"][1] - state["b"][1]) <= 50
    assert abs(state["a"][0] - state["b"][0]) <= 4


# -- the autoscaler on a simulated clock ----------------------------------------------------------
def run(scaler, current, demands, start=0.0, tick=1.0):
    """Drive ``scaler`` one tick per demand; the replica count follows every decision."""
    history = []
    now = start
    for demand in demands:
        current = scaler.decide(now, current, demand).replicas
        history.append(current)
        now += tick
    return history


def test_bounds_hold_whatever_the_demand():
    config = ScalingConfig(
        min_replicas=2, max_replicas=5, target_per_replica=10, up_delay_s=0, down_delay_s=0, up_interval_s=0,
        down_interval_s=0, max_step_up=100, max_step_down=100, quota_hold=1.0,
    )  # fmt: skip
    scaler = Autoscaler(config)
    assert run(scaler, 2, [1000, 1000, 0, 0]) == [5, 5, 2, 2]
    assert scaler.decide(0, 9, 1000).replicas == 5  # outside the bounds: back inside at once
    assert scaler.decide(0, 0, 0).replicas == 2


def test_scale_up_waits_for_the_delay_then_steps_at_the_rate_limit():
    config = ScalingConfig(
        min_replicas=1,
        max_replicas=20,
        target_per_replica=10,
        up_delay_s=3,
        up_interval_s=2,
        max_step_up=2,
    )
    history = run(Autoscaler(config), 1, [100] * 12)  # wants 10
    # t=0..2: delay; t=3: +2; t=5: +2; t=7: +2; t=9: +2; t=11: +1 (reaches 10)
    assert history == [1, 1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 10]


def test_a_dip_restarts_the_delay():
    config = ScalingConfig(min_replicas=1, max_replicas=10, target_per_replica=10, up_delay_s=3, up_interval_s=0)
    assert run(Autoscaler(config), 1, [50, 50, 0, 50, 50, 50, 50]) == [1, 1, 1, 1, 1, 1, 3]


def test_scale_down_waits_and_steps_one_at_a_time():
    config = ScalingConfig(
        min_replicas=1, max_replicas=10, target_per_replica=10, down_delay_s=5, down_interval_s=3, max_step_down=1,
        quota_hold=1.0,
    )  # fmt: skip
    history = run(Autoscaler(config), 6, [0] * 16)
    assert history == [6, 6, 6, 6, 6, 5, 5, 5, 4, 4, 4, 3, 3, 3, 2, 2]


def test_no_scale_down_above_the_quota_hold():
    config = ScalingConfig(
        min_replicas=1,
        max_replicas=10,
        target_per_replica=10,
        down_delay_s=0,
        down_interval_s=0,
        max_step_down=10,
    )  # quota_hold 0.8
    scaler = Autoscaler(config)
    decision = scaler.decide(0, 10, 85)  # the load wants 9 of 10 (0.9 of the quota): held at 10
    assert decision.replicas == 10 and "quota" in decision.reason and decision.wanted == 9
    assert scaler.decide(1, 10, 75).replicas == 8  # wants 8 of 10: 0.8 is not above 0.8, released


def test_a_fleet_grown_past_the_quota_hold_shrinks_when_the_load_falls():
    """The hold reads the load, not the replicas held: all 10 replicas at the peak (the load
    wants 9, above 0.8 of the quota: held) are given back step by step once the load falls."""
    config = ScalingConfig(
        min_replicas=1, max_replicas=10, target_per_replica=10, down_delay_s=0, down_interval_s=0, max_step_down=2,
    )  # fmt: skip
    scaler = Autoscaler(config)
    held = scaler.decide(0, 10, 88)  # wants 9: the load is at 0.9 of the quota
    assert held.replicas == 10 and "quota" in held.reason
    history, current = [], 10
    for t in range(1, 6):  # the night: the load falls to 1 replica's worth
        current = scaler.decide(t, current, 5).replicas
        history.append(current)
    assert history == [8, 6, 4, 2, 1]


def test_spare_pool_rides_on_top_of_demand():
    config = ScalingConfig(
        min_replicas=0, max_replicas=10, target_per_replica=100, spare=2, up_delay_s=0, up_interval_s=0,
        max_step_up=10,
    )  # fmt: skip
    scaler = Autoscaler(config)
    assert scaler.wanted(0) == 2 and scaler.wanted(250) == 5 and scaler.wanted(10**9) == 10
    assert scaler.decide(0, 0, 250).replicas == 5


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target_per_replica"):
        ScalingConfig(target_per_replica=0)


# -- the command line (no Ray needed: it checks its arguments first) ------------------------------
def cluster_command(capsys, *args):
    from deepinfer_core.entrypoints.main import main

    status = main(["cluster", *args])
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prefill", "1"], "give --kv-store"),
        (["--decode", "0"], "--decode >= 1"),
        (["--autoscale", "decode=4:2"], "0 <= min <= max"),
        (["--autoscale", "3"], "[ROLE=]MIN:MAX"),
        (["--autoscale", "vision=1:2"], "unknown role 'vision'"),
        (["--tier-bounds", "16k,64k"], "--tier-bounds"),
        (["--drain-timeout", "0"], "--drain-timeout must be > 0"),
        (["--kv-lease", "0"], "--kv-lease must be > 0"),
    ],
)
def test_cluster_command_errors_are_one_line(capsys, args, needle):
    status, err = cluster_command(capsys, *args)
    assert status == 2 and err.startswith("deepinfer cluster: error:") and needle in err
    assert err.count("\n") == 1


def test_autoscale_values():
    from deepinfer_core.entrypoints.cluster import parse_autoscale

    assert parse_autoscale(["1:4"], prefill=0) == {"decode": (1, 4)}
    assert parse_autoscale(["1:4", "prefill=2:3"], prefill=1) == {"decode": (1, 4), "prefill": (2, 3)}


# -- a stream continued on another replica (the ingress's side of a kill or a drain) --------------
class _Sink:
    def __init__(self):
        self.outs, self.admitted, self.closed = [], [], []

    def admit(self, error):
        self.admitted.append(error)

    def put(self, out):
        self.outs.append((list(out.outputs[0].token_ids), out.outputs[0].text, out.num_cached_tokens))

    def close(self, exc=None):
        self.closed.append(exc)


def _snapshot(prompt, ids, text, cached):
    from types import SimpleNamespace

    return SimpleNamespace(
        prompt_token_ids=list(prompt), num_cached_tokens=cached,
        outputs=[SimpleNamespace(token_ids=list(ids), text=text)],
    )  # fmt: skip


def test_a_continued_stream_sends_each_token_once_and_counts_the_moved_kv():
    pytest.importorskip("starlette")  # the ingress module builds on the server (the serve extra)
    from deepinfer_core import SamplingParams
    from deepinfer_core.cluster.ingress import _Continuation
    from deepinfer_core.cluster.jobs import Job

    counters, sink = {}, _Sink()
    prompt = tuple(range(300))
    stream = _Continuation(Job("r", prompt, SamplingParams(temperature=0, max_tokens=6)), sink, counters)
    first = stream.job()
    assert first.prompt_token_ids == prompt and counters.get("migrations", 0) == 0
    stream.put(_snapshot(prompt, [7], "a", 256))
    stream.put(_snapshot(prompt, [7, 8], "ab", 256))
    # the replica went away after 2 tokens: the next attempt sends them as prompt, asks for the rest
    second = stream.job()
    assert second.prompt_token_ids == prompt + (7, 8) and second.params.max_tokens == 4
    assert second.request_id != first.request_id and second.block_keys == ()
    stream.put(_snapshot(second.prompt_token_ids, [9], "c", 256))  # the other replica loaded 2 blocks
    stream.put(_snapshot(second.prompt_token_ids, [9, 10], "cd", 256))
    stream.end()
    assert [o[:2] for o in sink.outs] == [([7], "a"), ([7, 8], "ab"), ([7, 8, 9], "abc"), ([7, 8, 9, 10], "abcd")]
    assert [o[2] for o in sink.outs] == [256] * 4  # the client's usage: the first attempt's
    assert counters == {"migrations": 1, "migrated_cached_tokens": 256}
    assert sink.admitted == [None]
