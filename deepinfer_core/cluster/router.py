"""The load balancer's policies: where a prefill job and where a decode job go.

Pure functions of what replicas last published (:class:`ReplicaLoad`); no Ray, no clock, no
round trip to any replica per request. :mod:`.ray_glue` calls them from Ray Serve's request
router, the simulator calls them directly.

Prefill (:func:`route_prefill`)::

    cached(r)  = tokens of the prompt's leading blocks replica r holds (its published hash chain)
    uncached   = prompt - max cached(r)
    tier       = bucket of uncached: < 16K | 16-64K | 64-256K | >= 256K   (RouterConfig.tier_bounds)
    pool       = the replicas holding the longest cached prefix, if any holds one; else the
                 replicas serving the tier (sorted by name, split into tiers in order), so that
                 long cold prompts and short ones queue on different replicas
    choice     = the least loaded of the pool, unless it is overloaded
                 against the least loaded replica of any tier (load - least > imbalance_abs and
                 load > imbalance_ratio * least): then that one. A hot prefix must not pile onto
                 one replica, nor a busy tier (agent traffic is mostly the shortest) onto its few.

Decode (:func:`route_decode`): a decode job brings its whole prompt plus ``max_tokens`` of KV.
Long jobs go to the replica with the least resident KV, short ones to the replica with the most
resident KV that has room for them, among the replicas whose running count is within
``decode_slack`` of the least busy: resident KV evens out while request counts stay balanced.

At scale (hundreds of replicas, each publishing tens of thousands of block digests) matching a
prompt against every replica's published set costs replicas x chain per request, and rebuilding
those sets on every request costs far more. A :class:`PrefixIndex` (digest -> the replicas
holding it, updated from each replica's publications as a diff) answers the same question in
chain x holders: ``route_prefill(..., index=idx)`` makes the same decision from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Iterable, Sequence

__all__ = [
    "KEY_DIGEST_BYTES",
    "Decision",
    "PrefixIndex",
    "ReplicaLoad",
    "RouterConfig",
    "cached_blocks",
    "digest",
    "route_decode",
    "route_prefill",
    "tier_members",
    "tier_of",
]

KEY_DIGEST_BYTES = 8  # replicas publish this much of each block key (collisions only cost a miss)


def digest(key: bytes) -> bytes:
    return key[:KEY_DIGEST_BYTES]


@dataclass(frozen=True)
class ReplicaLoad:
    """What one replica last published about itself."""

    name: str
    role: str = "both"  # "prefill" | "decode" | "both" (colocated)
    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0  # uncached prompt tokens queued or being prefilled (prefill load)
    resident_blocks: int = 0  # KV blocks held by its requests
    num_blocks: int = 1
    prefix_keys: frozenset = frozenset()  # digests of the block keys its device cache holds

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.resident_blocks


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 128
    tier_bounds: tuple[int, ...] = (16 * 1024, 64 * 1024, 256 * 1024)  # uncached tokens: four tiers
    imbalance_abs: int = 32 * 1024  # prefill load is queued uncached tokens
    imbalance_ratio: float = 1.5
    decode_slack: int = 2  # running requests above the least busy replica that still count as even

    def __post_init__(self) -> None:
        if list(self.tier_bounds) != sorted(self.tier_bounds) or any(b <= 0 for b in self.tier_bounds):
            raise ValueError(f"tier bounds must be positive and increasing, got {self.tier_bounds}")


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str  # "longest cached prefix" | "imbalance override" | "least loaded" | "long request" | ...
    tier: int | None = None
    cached_tokens: int = 0
    uncached_tokens: int = 0
    alternatives: dict = field(default_factory=dict)  # replica -> its cached tokens (prefill)


def tier_of(uncached_tokens: int, bounds: Sequence[int]) -> int:
    """0 for the shortest tier ... len(bounds) for the longest."""
    return sum(1 for b in bounds if uncached_tokens >= b)


def tier_members(replicas: Sequence[ReplicaLoad], tier: int, num_tiers: int) -> list[ReplicaLoad]:
    """The replicas that serve ``tier``: sorted by name and split into ``num_tiers`` runs in
    order (4 replicas: one each; 2 replicas: tiers 0-1 on the first, 2-3 on the second)."""
    ordered = sorted(replicas, key=lambda r: r.name)
    n = len(ordered)
    if n >= num_tiers:
        return [r for i, r in enumerate(ordered) if i * num_tiers // n == tier]
    return [ordered[tier * n // num_tiers]]


def cached_blocks(keys: Sequence[bytes], prefix_keys: frozenset) -> int:
    """Leading blocks of the chain ``keys`` found among ``prefix_keys`` (digests)."""
    n = 0
    for key in keys:
        if digest(key) not in prefix_keys:
            break
        n += 1
    return n


def _imbalanced(loads: Sequence[float], config: RouterConfig) -> bool:
    hi, lo = max(loads), min(loads)
    return hi - lo > config.imbalance_abs and hi > config.imbalance_ratio * lo


class PrefixIndex:
    """Which replicas hold each published block-key digest.

    ``publish(name, digests)`` replaces what a replica holds (the router calls it when a
    replica's published stats change; the cost is the difference from its last publication);
    ``add`` / ``discard`` change one digest (a simulator that knows each insert and eviction).
    :meth:`longest` finds the longest leading run of a prompt's chain that any of a set of
    replicas holds, and which of them hold it, by intersecting holder sets block by block."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._held: dict[str, set[bytes]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def held(self, name: str) -> frozenset:
        return frozenset(self._held.get(name, ()))

    def add(self, name: str, key_digest: bytes) -> None:
        held = self._held.setdefault(name, set())
        if key_digest not in held:
            held.add(key_digest)
            self._holders.setdefault(key_digest, set()).add(name)

    def discard(self, name: str, key_digest: bytes) -> None:
        held = self._held.get(name)
        if held is not None and key_digest in held:
            held.discard(key_digest)
            holders = self._holders[key_digest]
            holders.discard(name)
            if not holders:
                del self._holders[key_digest]

    def publish(self, name: str, digests: Iterable[bytes]) -> None:
        new = set(digests)
        old = self._held.get(name, set())
        for d in old - new:
            self.discard(name, d)
        for d in new - old:
            self.add(name, d)
        self._held.setdefault(name, set())

    def drop(self, name: str) -> None:
        """Forget a replica (removed from the deployment)."""
        for d in list(self._held.get(name, ())):
            self.discard(name, d)
        self._held.pop(name, None)

    def longest(self, keys: Sequence[bytes], limit: int, among: "set[str] | frozenset[str]") -> tuple[int, set[str]]:
        """(blocks, replicas): the longest leading run of ``keys`` (at most ``limit`` blocks)
        that a replica of ``among`` holds in full, and every replica of ``among`` holding it;
        (0, empty) when none holds the first block."""
        live: set[str] | None = None
        depth = 0
        for key in keys[:limit]:
            holders = self._holders.get(digest(key))
            if not holders:
                break
            nxt = (holders & among) if live is None else (live & holders)
            if not nxt:
                break
            live, depth = nxt, depth + 1
        return depth, live or set()

    def leading(self, name: str, keys: Sequence[bytes], limit: int) -> int:
        """Leading blocks of ``keys`` (at most ``limit``) that replica ``name`` holds."""
        return min(cached_blocks(keys, self._held.get(name, frozenset())), limit)


def route_prefill(
    keys: Sequence[bytes],
    prompt_tokens: int,
    replicas: Sequence[ReplicaLoad],
    config: RouterConfig,
    index: PrefixIndex | None = None,
) -> Decision:
    """``keys``: the prompt's block chain (its full blocks); at least one replica.

    ``index``: where the replicas' held blocks are looked up instead of their ``prefix_keys``
    (the same decision; ``Decision.alternatives`` then lists only the replicas holding the
    longest prefix)."""
    if not replicas:
        raise ValueError("no prefill replica to route to")
    bs = config.block_size
    usable = (prompt_tokens - 1) // bs  # the last token is always computed
    if index is None:
        cached = {r.name: min(cached_blocks(keys, r.prefix_keys), usable) * bs for r in replicas}
        longest = max(cached.values())
        alternatives = cached
    else:
        depth, holders = index.longest(keys, usable, {r.name for r in replicas})
        longest = depth * bs
        alternatives = {name: longest for name in sorted(holders)}
    tier = tier_of(prompt_tokens - longest, config.tier_bounds)
    if longest:  # the replicas holding the longest prefix, whatever their tier: the job is short there
        pool = [r for r in replicas if alternatives.get(r.name) == longest]
    else:
        pool = tier_members(replicas, tier, len(config.tier_bounds) + 1)
    by_load = attrgetter("waiting_tokens", "name")
    best = min(pool, key=by_load)
    least = min(replicas, key=by_load)
    reason = "longest cached prefix" if longest else "least loaded"
    if least is not best and _imbalanced([best.waiting_tokens, least.waiting_tokens], config):
        best, reason = least, "imbalance override"
    got = alternatives.get(best.name)
    if got is None:  # an override to a replica outside the index's longest holders
        got = index.leading(best.name, keys, usable) * bs
    return Decision(best.name, reason, tier, got, prompt_tokens - got, alternatives)


class RoutedLedger:
    """What one router has sent each replica that the replica's published load may not show yet.

    Replicas publish their load every few hundred milliseconds, so requests that arrive together
    all see the same stale figures and pile onto the replica that looked least busy
    (``cluster_bench.py`` saw decode jobs split 6 : 14 between two replicas). The router records
    each job it routes (time, prompt tokens, KV blocks) and adds to a replica's published load
    the jobs sent after that load's timestamp (``at``, the replica's clock; less
    :data:`TRANSIT_S` for the call still on its way). Loads without a timestamp count the jobs of
    the last :data:`UNTIMED_S`."""

    TRANSIT_S = 0.1
    UNTIMED_S = 1.0
    HORIZON_S = 30.0  # entries older than this are dropped

    def __init__(self) -> None:
        self._sent: dict[str, list[tuple[float, int, int]]] = {}

    def record(self, name: str, now: float, tokens: int, blocks: int) -> None:
        sent = self._sent.setdefault(name, [])
        sent.append((now, tokens, blocks))
        if sent[0][0] < now - self.HORIZON_S:
            self._sent[name] = [x for x in sent if x[0] >= now - self.HORIZON_S]

    def adjust(self, load: ReplicaLoad, at: float | None, now: float) -> ReplicaLoad:
        since = now - self.UNTIMED_S if at is None else at - self.TRANSIT_S
        unseen = [x for x in self._sent.get(load.name, ()) if x[0] > since]
        if not unseen:
            return load
        return replace(
            load,
            running=load.running + len(unseen),
            waiting_tokens=load.waiting_tokens + sum(x[1] for x in unseen),
            resident_blocks=load.resident_blocks + sum(x[2] for x in unseen),
        )


def route_decode(
    prompt_tokens: int, max_tokens: int, replicas: Sequence[ReplicaLoad], config: RouterConfig
) -> Decision:
    """Place a decode job of ``prompt_tokens`` + up to ``max_tokens`` so resident KV evens out."""
    if not replicas:
        raise ValueError("no decode replica to route to")
    need = -(-(prompt_tokens + max_tokens) // config.block_size)
    fits = [r for r in replicas if r.free_blocks >= need] or list(replicas)
    least_busy = min(r.running for r in fits)
    even = [r for r in fits if r.running <= least_busy + config.decode_slack]
    running = sum(r.running for r in replicas)
    # long or short against the requests already resident (mean blocks per running request)
    typical = sum(r.resident_blocks for r in replicas) / running if running else 0
    if need >= typical:
        best = min(even, key=lambda r: (r.resident_blocks, r.running, r.name))
        reason = "long request: least resident KV"
    else:
        best = max(even, key=lambda r: (r.resident_blocks, -r.running, r.name))
        reason = "short request: most resident KV"
    return Decision(best.name, reason)
