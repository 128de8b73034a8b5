"""Block bytes between the KV cache and a persistent store: the layout of one block as bytes,
the host pool that holds them, and the host -> device copy that feeds them back.

Everything device-specific goes through ``torch.get_device_module(device)`` (``torch.cuda``
on a GPU, ``torch.cpu``'s no-op streams and events on the host), so the same code runs, and
is tested, on a CPU: only the synchronisation it orders is new on a GPU.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Sequence

import torch

PREFAULT_BYTES = 256 * 2**20  # host buffers touched at start, off the critical path (see HostPool)
SLAB_BYTES = 64 * 2**20  # host buffers are carved from slabs this large (one pinned allocation each)
ALIGN = 64  # each buffer starts at a multiple of this (cache lines; dtype views of any part)


class BlockCopier:
    """Copies one block id of every layer's cache to or from a flat byte buffer."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_dims: Sequence[int]) -> None:
        self.kv_caches = list(kv_caches)
        self.block_dims = list(block_dims)
        self.parts = []  # (offset, nbytes, dtype, block-slice shape) per layer
        offset = 0
        for cache, dim in zip(self.kv_caches, self.block_dims):
            shape = cache.select(dim, 0).shape
            nbytes = cache.select(dim, 0).numel() * cache.element_size()
            offset = -(-offset // cache.element_size()) * cache.element_size()  # a dtype view needs it
            self.parts.append((offset, nbytes, cache.dtype, shape))
            offset += nbytes
        self.block_bytes = offset
        self._rows = self._byte_rows()

    def _byte_rows(self) -> list | None:
        """Per layer, the cache's bytes as a (rows, blocks, row bytes) array: a block's slice
        is ``rows`` contiguous runs, in the order :meth:`to_host` lays them out. None unless
        every cache is a contiguous host tensor and the parts are packed (no padding)."""
        rows, end = [], 0
        for cache, dim, (off, n, _dtype, _shape) in zip(self.kv_caches, self.block_dims, self.parts):
            if cache.device.type != "cpu" or not cache.is_contiguous() or off != end:
                return None
            lead = 1
            for size in cache.shape[:dim]:
                lead *= size
            flat = cache.reshape(-1).view(torch.uint8)
            rows.append(flat.view(lead, cache.shape[dim], n // max(1, lead)).numpy())
            end = off + n
        return rows

    def scatter(self, block: int) -> list[memoryview] | None:
        """The block's bytes in the cache itself, as views in record order (a store reads a
        record straight into them), or None when the layout does not allow it."""
        if self._rows is None:
            return None
        return [memoryview(rows[i, block]) for rows in self._rows for i in range(rows.shape[0])]

    def to_host(self, block: int, out: torch.Tensor) -> None:
        """Device -> host, synchronous: ``out`` is complete when this returns."""
        for cache, dim, (off, n, dtype, shape) in zip(self.kv_caches, self.block_dims, self.parts):
            out[off : off + n].view(dtype).view(shape).copy_(cache.select(dim, block))

    def to_device(self, block: int, src: torch.Tensor) -> None:
        """Host -> device, asynchronous from pinned memory: ``src`` must not change until the
        copy has run on the device (:class:`HostToDevice` holds it until then)."""
        for cache, dim, (off, n, dtype, shape) in zip(self.kv_caches, self.block_dims, self.parts):
            cache.select(dim, block).copy_(src[off : off + n].view(dtype).view(shape), non_blocking=True)


class HostPool:
    """Block bytes in host memory (pinned when the device is not the host), LRU-bounded.

    Buffers are recycled: a buffer the pool evicts and nobody else holds goes to a spare list
    that :meth:`new_buffer` takes from first, and :meth:`prefault` fills that list at start.
    Why: reading a block into freshly allocated memory page-faults every 4 KiB page inside the
    read, which made a store load run at a fifth of the speed of a read into touched memory
    (benchmarks/README.md, persistent KV cache). Buffers are views of 64 MiB slabs: one
    pinned allocation per slab, not per block (tens of thousands of ``cudaHostAlloc`` calls
    for small blocks, which would keep the loader busy for seconds before its first load)."""

    def __init__(self, capacity_blocks: int, block_bytes: int, pin: bool) -> None:
        self.capacity = max(1, capacity_blocks)
        self.block_bytes = block_bytes
        self.stride = -(-block_bytes // ALIGN) * ALIGN
        self.pin = pin
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._spare: list[torch.Tensor] = []
        self._carved: list[torch.Tensor] = []  # the rest of the newest slab
        self._held: list[torch.Tensor] = []  # evicted while someone still held them: spares later
        self._lock = threading.Lock()

    def prefault(self, max_bytes: int = PREFAULT_BYTES) -> None:
        """Allocate and touch up to ``max_bytes`` of spare buffers (never past capacity)."""
        count = min(self.capacity, max(0, max_bytes // max(1, self.stride)))
        fresh = self._slab(count)
        for buf in fresh:
            buf.zero_()
        with self._lock:
            self._spare.extend(fresh)

    def new_buffer(self) -> torch.Tensor:
        with self._lock:
            if self._spare:
                return self._spare.pop()
            if self._reclaim():
                return self._spare.pop()
            if self._carved:
                return self._carved.pop()
        fresh = self._slab(max(1, min(self.capacity, SLAB_BYTES // self.stride)))
        with self._lock:
            self._carved.extend(fresh[1:])
        return fresh[0]

    def _slab(self, count: int) -> list[torch.Tensor]:
        """``count`` buffers of ``block_bytes``, views of one allocation."""
        if count == 0:
            return []
        slab = None
        if self.pin:
            try:
                slab = torch.empty(count * self.stride, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no pinning on this host: pageable memory still works
                self.pin = False
        if slab is None:
            slab = torch.empty(count * self.stride, dtype=torch.uint8)
        return [slab[i * self.stride : i * self.stride + self.block_bytes] for i in range(count)]

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            buf = self._blocks.get(key)
            if buf is not None:
                self._blocks.move_to_end(key)
            return buf

    def put(self, key: bytes, buf: torch.Tensor) -> None:
        with self._lock:
            self._blocks[key] = buf
            self._blocks.move_to_end(key)
            while len(self._blocks) > self.capacity:
                _, old = self._blocks.popitem(last=False)
                # Recycled only when this frame holds the last reference (getrefcount's own
                # argument and ``old``): a pending write, a load result or a host -> device copy
                # still in flight (HostToDevice) keeps its buffer.
                if sys.getrefcount(old) <= 2 and len(self._spare) < self.capacity:
                    self._spare.append(old)
                elif len(self._held) < self.capacity:
                    self._held.append(old)  # a view dropped here would pin its whole slab
                del old

    def _reclaim(self) -> int:
        """Move held buffers nobody else references any more to the spare list (lock held)."""
        keep = []
        while self._held:
            buf = self._held.pop()
            # references: ``buf`` and getrefcount's argument; more means someone still reads it
            (self._spare if sys.getrefcount(buf) <= 2 else keep).append(buf)
            del buf
        self._held = keep
        return len(self._spare)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)


class HostToDevice:
    """Host -> device block copies on a stream of their own, fenced by an event.

    Why: a copy from pinned memory returns before the device has read the source. The copies
    run on a side stream (asynchronous to the step loop, which goes on building the step's
    inputs); the compute stream waits for their event on the device, not the host, before the
    forward that reads the blocks; and the source buffers stay referenced here until the event
    has passed, so the host pool cannot recycle a buffer into a new load while the DMA still
    reads it. On the CPU the copies are synchronous and the streams and events are no-ops."""

    def __init__(self, copier: BlockCopier, device: torch.device, api=None) -> None:
        self.copier = copier
        self.api = api if api is not None else torch.get_device_module(device)
        self.device = device
        self.stream = self.api.Stream() if device.type == "cpu" else self.api.Stream(device=device)
        self._in_flight: list[tuple[object, list[torch.Tensor]]] = []  # (event, source buffers)

    def copy(self, pairs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Copy each (device block, host buffer); the compute stream is ordered after them."""
        self.reap()
        if not pairs:
            return
        compute = self.api.current_stream(self.device)
        self.stream.wait_stream(compute)  # the blocks were free, but a queued kernel may still read them
        with self.api.stream(self.stream):
            for block, buf in pairs:
                self.copier.to_device(block, buf)
            event = self.api.Event()
            event.record(self.stream)
        compute.wait_event(event)
        self._in_flight.append((event, [buf for _, buf in pairs]))

    def reap(self) -> None:
        """Drop the buffers of copies the device has finished."""
        self._in_flight = [(e, bufs) for e, bufs in self._in_flight if not e.query()]

    def held(self) -> int:
        """Host buffers still read by copies in flight."""
        return sum(len(bufs) for _, bufs in self._in_flight)
