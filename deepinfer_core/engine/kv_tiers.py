"""The KV cache beyond device memory: device blocks -> host pool -> persistent store.

::

    admission (scheduler)            device pool ── hit ──────────────────────────┐
      walk the hash chain:           host pool   ── hit: copy host -> device ─────┤ prefix
                                     store.match_prefix ── hit: load, wait ───────┘ blocks
    loader thread:   store.acquire_read -> read_into(host buffers) -> release -> host pool
    after each step: newly computed full blocks: device -> host copy (step loop, a memcpy),
    writer thread:   store.reserve_write -> write_from -> commit      (failures: logged, counted)

Why this split: the step loop never waits on the store. A request whose blocks are in the
store is set aside while the loader reads them (other requests keep running); the next
schedule promotes the loaded blocks into the device pool as ordinary cached blocks, so the
device prefix cache serves them and ``num_cached_tokens`` counts them. Blocks are bytes in
the store: one block is every layer's slice for that block id, back to back, in
``kv_caches`` order (the namespace fingerprints that layout, so a mismatch is never read).
On a GPU the host buffers are pinned and host -> device copies run on a side stream fenced
by an event (engine/kv_host.py). On the CPU, where the cache is host memory, a load reserves
the request's cache blocks at admission and reads each record straight into them (a scatter
list of per-layer slices; no host buffer, no copy per layer at promotion): a higher
store -> cache bandwidth than the two-hop path (benchmarks/README.md, fourth run).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Sequence

import torch

from ..kv_store import KVStore
from .kv_cache_manager import KVCacheManager
from .kv_host import BlockCopier, HostPool, HostToDevice
from .request import Request

log = logging.getLogger(__name__)
GC_INTERVAL_S = 600.0  # the writer thread runs store.gc() this often (expired blocks, stale temp files)
LOAD_THREADS = 4  # store reads in parallel (file I/O and crc32c release the GIL)
REVALIDATE_S = 600.0  # a block the store held already (another writer's, or loaded) is trusted this long


def block_dim(shape_one: Sequence[int], shape_two: Sequence[int]) -> int:
    """The dimension of a cache shape that counts blocks (the one that grows 1 -> 2)."""
    dims = [i for i, (a, b) in enumerate(zip(shape_one, shape_two)) if a != b]
    if len(dims) != 1:
        raise ValueError(f"cannot tell the block dimension of KV cache shapes {tuple(shape_one)} / {tuple(shape_two)}")
    return dims[0]


@dataclass(frozen=True)
class DirectLoad:
    """A load read straight into reserved cache blocks: the first ``good`` verified."""

    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]
    good: int


class KVTiers:
    """The host pool, the loader and the writer of one engine, around one store."""

    def __init__(
        self,
        store: KVStore,
        kv: KVCacheManager,
        copier: BlockCopier,
        host_pool: HostPool,
        device: torch.device | None = None,
    ) -> None:
        self.store = store
        self.kv = kv
        self.copier = copier
        self.host = host_pool
        self.h2d = HostToDevice(copier, device or torch.device("cpu"))
        # On the CPU a load reads records straight into reserved cache blocks (no host-buffer
        # hop, no copy per layer at admission) when the store takes scatter lists.
        self.direct = (
            (device is None or device.type == "cpu")
            and getattr(store, "scatter_reads", False)
            and copier.scatter(0) is not None
        )
        self._orphans: list[Future] = []  # direct loads of requests that left: blocks to release
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-kv-load")
        self._readers = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="deepinfer-kv-read")
        self._loader.submit(host_pool.prefault)  # before any load: the loader runs in order
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-kv-write")
        self._loads: dict[str, Future] = {}  # request id -> load of its store blocks
        self._loaded: set[str] = set()  # requests whose load finished (no second lookup)
        self._writes: list[Future] = []
        # key -> time.time() until which it is surely in the store (or queued for it): a block
        # produced again before then is not copied again; after then it is offered again, and
        # the store rewrites it if its record expired (retention is per write, not forever).
        self._known: dict[bytes, float] = {}
        retention = getattr(store, "retention_seconds", None)
        self._retention: dict[str, float] = dict(retention()) if callable(retention) else {}
        self._trust_s = min([REVALIDATE_S, *self._retention.values()])
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self._last_gc = time.monotonic()

    # -- admission --------------------------------------------------------------------------
    def admit(self, req: Request, device_hits: list[int]) -> list[int] | None:
        """The request's prefix blocks after looking past the device cache, or None while its
        blocks are loading from the store (the scheduler sets the request aside)."""
        self._settle_orphans()
        loaded: dict[bytes, torch.Tensor] = {}  # this request's load (the host pool may be smaller)
        if req.request_id in self._loads:
            if not self._loads[req.request_id].done():
                return None
            result = self._loads.pop(req.request_id).result()
            self._loaded.add(req.request_id)
            if isinstance(result, DirectLoad):
                self._settle(result)
                device_hits = self.kv.match_prefix(req)
            else:
                loaded = dict(result)
        usable = req.block_keys[: (req.num_tokens - 1) // self.kv.block_size]
        start = len(device_hits)
        in_host = 0
        while start + in_host < len(usable) and (
            usable[start + in_host] in loaded or usable[start + in_host] in self.host
        ):
            in_host += 1
        rest = usable[start + in_host :]
        if rest and req.request_id not in self._loaded:
            try:
                in_store = self.store.match_prefix(rest)
            except Exception as exc:  # a store that fails is a miss, never an engine error
                log.warning("KV store match_prefix failed: %s", exc)
                self.counters["store_errors"] += 1
                in_store = 0
            if in_store:
                keys = tuple(rest[:in_store])
                blocks = self._reserve(req, device_hits, len(keys)) if self.direct else []
                if blocks:
                    self._loads[req.request_id] = self._loader.submit(self._load_direct, keys, blocks)
                else:
                    self._loads[req.request_id] = self._loader.submit(self._load, keys)
                return None
        self._loaded.discard(req.request_id)
        if in_host == 0:
            return device_hits
        self._promote(device_hits, usable[start : start + in_host], loaded)
        return self.kv.match_prefix(req)

    def _promote(self, device_hits: list[int], keys: Sequence[bytes], loaded: dict[bytes, torch.Tensor]) -> None:
        """Host -> device: each block becomes a cached, unreferenced device block. The device
        hits are held meanwhile so that the allocations cannot evict them."""
        pool = self.kv.pool
        for block in device_hits:
            pool.touch(block)
        copies = []
        copied = False
        try:
            for key in keys:
                if pool.num_free == 0:
                    break
                buf = loaded.get(key)
                if buf is None:
                    buf = self.host.get(key)
                if buf is None:
                    break
                copies.append((pool.allocate(), buf))  # held until registered: no allocation here evicts it
            start = time.perf_counter()
            self.h2d.copy(copies)  # on the device, the next forward runs after these copies
            self.counters["host_to_device_seconds"] += time.perf_counter() - start
            copied = True
        finally:
            for key, (block, _) in zip(keys, copies):
                if copied:  # a failed copy leaves the blocks free and unnamed
                    pool.register(block, key)
                pool.release(block)
            for block in device_hits:
                pool.release(block)
        self.counters["host_to_device_blocks"] += len(copies)

    def _load(self, keys: tuple[bytes, ...]) -> list[tuple[bytes, torch.Tensor]]:
        """Loader thread: store -> host buffers (also put in the host pool), the leading
        blocks that read and verify."""
        bufs = [self.host.new_buffer() for _ in keys]
        n = self._read(keys, [memoryview(b.numpy()) for b in bufs])
        for key, buf in zip(keys[:n], bufs[:n]):
            self.host.put(key, buf)
        return list(zip(keys[:n], bufs[:n]))

    def _load_direct(self, keys: tuple[bytes, ...], blocks: list[int]) -> DirectLoad:
        """Loader thread: store -> the reserved cache blocks themselves (CPU). Never raises:
        the step loop must get its blocks back (:meth:`_settle`)."""
        try:
            n = self._read(keys, [self.copier.scatter(b) for b in blocks])
        except Exception as exc:  # _read catches store errors; anything else still frees the blocks
            log.warning("KV store direct load of %d blocks failed: %s", len(keys), exc)
            n = 0
        self.counters["store_to_cache_blocks"] += n
        return DirectLoad(keys, tuple(blocks), n)

    def _read(self, keys: tuple[bytes, ...], dests: list) -> int:
        """Read ``keys`` into ``dests`` (one buffer or scatter list each) in parallel leases;
        returns how many leading blocks read and verified."""
        start = time.perf_counter()
        step = -(-len(keys) // LOAD_THREADS)
        chunks = [(keys[i : i + step], dests[i : i + step]) for i in range(0, len(keys), step)]
        leases = []
        try:
            for chunk_keys, _ in reversed(chunks):  # the head's lease last: it ends most recently used
                leases.insert(0, self.store.acquire_read(chunk_keys))
            ok = [
                good
                for part in self._readers.map(self.store.read_into, leases, [d for _, d in chunks])
                for good in part
            ]
        except Exception as exc:
            log.warning("KV store load of %d blocks failed: %s", len(keys), exc)
            self.counters["load_failures"] += 1
            return 0
        finally:
            for lease in leases:
                self.store.release(lease)
        n = next((i for i, good in enumerate(ok) if not good), len(ok))
        self.counters["load_seconds"] += time.perf_counter() - start
        self.counters["load_bytes"] += len(keys) * self.copier.block_bytes
        self.counters["store_blocks_loaded"] += n
        self.counters["store_blocks_missed"] += len(keys) - n
        trusted = time.time() + self._trust_s  # the record's own expiry is not known here
        with self._lock:
            self._known.update(dict.fromkeys(keys[:n], trusted))
        return n

    def _reserve(self, req: Request, device_hits: list[int], count: int) -> list[int]:
        """Device blocks for a direct load, or [] when the request's blocks would not fit
        now (the host path then loads them, as before). The device hits are held meanwhile."""
        pool = self.kv.pool
        needed = -(-(req.num_tokens + 1) // self.kv.block_size) - len(device_hits)
        if pool.num_free < needed:
            return []
        for block in device_hits:
            pool.touch(block)
        blocks = [pool.allocate() for _ in range(count)]
        for block in device_hits:
            pool.release(block)
        return blocks

    def _settle(self, load: DirectLoad) -> None:
        """Step loop: a direct load's verified leading blocks become cached device blocks; the
        rest go back unnamed (their bytes are whatever a failed read left)."""
        pool = self.kv.pool
        for i, (key, block) in enumerate(zip(load.keys, load.blocks)):
            if i < load.good:
                pool.register(block, key)
            pool.release(block)

    def _settle_orphans(self) -> None:
        """Release the blocks of direct loads whose requests left, once the read is over."""
        if self._orphans:
            for future in [f for f in self._orphans if f.done()]:
                self._orphans.remove(future)
                if isinstance(future.result(), DirectLoad):
                    self._settle(future.result())

    def loading(self, request_id: str) -> bool:
        future = self._loads.get(request_id)
        return future is not None and not future.done()

    def wait_for_loads(self, timeout: float) -> None:
        """Block until some load finishes (the scheduler has nothing else to run)."""
        pending = [f for f in self._loads.values() if not f.done()]
        if pending:
            wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def forget(self, request_id: str) -> None:
        """A request left (finished or aborted): drop its load bookkeeping. A direct load
        still reading into its reserved blocks keeps them until it ends (then they are
        released, and cached if they verified)."""
        future = self._loads.pop(request_id, None)
        self._loaded.discard(request_id)
        if future is not None and future.done() and isinstance(future.result(), DirectLoad):
            self._settle(future.result())
        elif future is not None and not future.done():
            self._orphans.append(future)

    # -- write-back -------------------------------------------------------------------------
    def write_back(self, requests: Sequence[Request]) -> None:
        """After a step: copy each request's newly computed full blocks to host buffers and
        queue them for the store. Runs on the step loop before any block can be reused;
        never raises (a block that is not written is only recomputed later). Its time on the
        step loop is counted in ``write_back_step_seconds`` (the issue's decode-overhead line)."""
        start = time.perf_counter()
        self._settle_orphans()
        try:
            self._write_back(requests)
        except Exception:
            log.exception("KV write-back failed; the blocks stay in the device cache only")
            self.counters["write_failures"] += 1
        self.counters["write_back_step_seconds"] += time.perf_counter() - start
        self.counters["write_back_steps"] += 1

    def _write_back(self, requests: Sequence[Request]) -> None:
        bs = self.kv.block_size
        for req in requests:
            full = min(req.num_computed_tokens // bs, len(req.block_keys), len(req.block_ids))
            if full <= req.num_stored_blocks:
                continue
            batch = []
            now = time.time()
            for i in range(req.num_stored_blocks, full):
                key = req.block_keys[i]
                with self._lock:
                    if self._known.get(key, 0.0) > now:
                        continue
                    self._known[key] = now + REVALIDATE_S  # queued; the writer sets the real time
                buf = self.host.get(key)
                if buf is None:
                    buf = self.host.new_buffer()
                    self.copier.to_host(req.block_ids[i], buf)
                    self.host.put(key, buf)
                batch.append((key, buf))
            req.num_stored_blocks = full
            if batch:
                self._writes = [f for f in self._writes if not f.done()]
                self._writes.append(self._writer.submit(self._write, batch, req.params.kv_retention))

    def _write(self, batch: list[tuple[bytes, torch.Tensor]], retention: str) -> None:
        """Writer thread: reserve -> write -> commit. Failures are logged and counted."""
        by_key = dict(batch)
        ticket = None
        try:
            start = time.time()  # before the store stamps its expiry: never later than it
            ticket = self.store.reserve_write([k for k, _ in batch], retention)
            reserved = set(ticket.keys)
            held = [k for k in by_key if k not in reserved]  # the store has them already
            with self._lock:
                self._known.update(dict.fromkeys(held, start + self._trust_s))
            if not ticket.keys:
                return
            self.store.write_from(ticket, [memoryview(by_key[k].numpy()) for k in ticket.keys])
            wanted, ticket_keys = len(ticket.keys), ticket.keys
            made = self.store.commit(ticket, [True] * wanted)
            ticket = None
            self.counters["blocks_written"] += made
            with self._lock:
                self._known.update(dict.fromkeys(ticket_keys, start + self._retention.get(retention, self._trust_s)))
                if made < wanted:  # dropped by the store (a full disk at commit, a lost race)
                    self.counters["blocks_not_committed"] += wanted - made
                    for key in by_key:
                        self._known.pop(key, None)
            self._maybe_gc()
        except Exception as exc:
            self.counters["write_failures"] += 1
            log.warning("KV store write-back of %d blocks failed (they stay recomputable): %s", len(batch), exc)
            with self._lock:
                for key in by_key:
                    self._known.pop(key, None)
            if ticket is not None:
                try:
                    self.store.commit(ticket, [False] * len(ticket.keys))  # drops the temp data
                except Exception:
                    pass

    def _maybe_gc(self) -> None:
        """Writer thread, between writes: the store's gc every :data:`GC_INTERVAL_S` (why
        here: it is off the step loop, and a store that is written to is one that grows)."""
        if time.monotonic() - self._last_gc < GC_INTERVAL_S:
            return
        self._last_gc = time.monotonic()
        now = time.time()
        with self._lock:
            for key in [k for k, until in self._known.items() if until <= now]:
                del self._known[key]  # offered again when produced again
        try:
            self.counters["gc_removed"] += self.store.gc()
        except Exception as exc:
            log.warning("KV store gc failed: %s", exc)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for queued write-backs (before exit, or before another process reads)."""
        wait(list(self._writes), timeout=timeout)

    def stats(self) -> dict:
        return {"host_pool_blocks": len(self.host), **self.counters, "store": self.store.stats()}

    def close(self) -> None:
        self.flush()
        self._loader.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.store.close()


def block_tensors(caches: Sequence) -> list[torch.Tensor]:
    """The paged (block KV) tensor of each layer's cache: the tensor itself, or the
    ``entries`` of a cache that keeps per-request state KV beside its blocks (DeepSeek-V4:
    compressed entries and indexer keys). Only block KV goes to the store; state KV is rebuilt
    after a hit by exact replay (engine/state_replay.py), as for a device prefix hit."""
    out = []
    for cache in caches:
        tensor = cache if isinstance(cache, torch.Tensor) else getattr(cache, "entries", None)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"kv_store does not support this model's KV layout: a {type(cache).__name__} has no paged block tensor"
            )
        out.append(tensor)
    return out


def cache_shapes(sizing) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each layer's block tensor shape at 1 and 2 blocks (on the meta device: no memory),
    from the engine's KV sizing; ValueError for layouts without a paged block tensor."""
    meta = torch.device("meta")
    one, two = block_tensors(sizing.allocate(1, meta)), block_tensors(sizing.allocate(2, meta))
    return [(tuple(a.shape), tuple(b.shape)) for a, b in zip(one, two)]


def open_tiers(
    url: str,
    *,
    namespace: str,
    kv: KVCacheManager,
    kv_caches: Sequence[torch.Tensor],
    shapes_one_two,
    device: torch.device,
    capacity_gib: float | None,
    host_pool_gib: float,
    plugin_host,
) -> KVTiers:
    """Open the store ``url`` names for this engine's namespace and block layout."""
    from ..kv_store.url import open_kv_store_url

    if not kv.enabled:
        raise ValueError("kv_store needs the prefix cache: drop enable_prefix_caching=False")
    dims = [block_dim(one, two) for one, two in shapes_one_two]
    copier = BlockCopier(block_tensors(kv_caches), dims)
    store = open_kv_store_url(
        url, namespace=namespace, block_bytes=copier.block_bytes, capacity_gib=capacity_gib, host=plugin_host
    )
    pool = HostPool(int(host_pool_gib * 2**30) // copier.block_bytes, copier.block_bytes, pin=device.type != "cpu")
    return KVTiers(store, kv, copier, pool, device)
