"""Reusable pinned host buffers for the per-step copies to and from an accelerator: the engine's
batches and readbacks, and models' own per-step index plans (DeepSeek-V4's prefill), so it sits
below both; :func:`to_device` and :func:`arrays_to_device` are the uploads they call.

Why: a fresh pinned buffer per step (``tensor.pin_memory()``) looked like ~4 ms of a 64 x 512-token
prefill's 7 ms batch build in a cProfile on the H200 (hostpath); measured in the steady state it is
~0.2 ms (torch's caching host allocator reuses pinned blocks), and keeping a few pinned buffers per
device here made the build 1.18-1.22x faster at that prefill, 1.01-1.10x at a 256-request decode
step (benchmarks/README.md, gpuhost).

The rule that keeps this correct: an asynchronous host-to-device copy reads its pinned source
when the device's queue reaches it, which with overlapped scheduling can be long after the host
moved on. So a buffer goes back to the free list only once an event recorded right after its copy
says that copy finished; until then the next upload takes another buffer (up to ``max_pending``,
then it waits for the oldest). Readback buffers (device -> host) are returned by their reader,
after it has read them.

Only torch's generic APIs are used (pinned ``torch.empty``, ``torch.Event``, the accelerator's
current stream), so any accelerator with pinned memory and events works; where either is missing
the copies fall back to plain synchronising ones. A CPU device never gets here.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Callable, Sequence

import numpy as np
import torch

_MIN_BYTES = 1 << 12


class _Slot:
    """One upload buffer: the pinned bytes, int64 views of them made once (torch and numpy),
    and the event recorded after the last copy that read them."""

    __slots__ = ("buf", "t64", "np64", "event", "nbytes")

    def __init__(self, buf: torch.Tensor, event) -> None:
        self.buf = buf
        self.nbytes = buf.numel()
        self.t64 = buf[: self.nbytes // 8 * 8].view(torch.int64)
        self.np64 = self.t64.numpy()
        self.event = event


def _round_up(nbytes: int) -> int:
    return max(_MIN_BYTES, 1 << (max(1, nbytes) - 1).bit_length())


class HostStaging:
    """Pinned upload and readback buffers for one device (thread-safe)."""

    def __init__(
        self,
        device: torch.device,
        *,
        max_pending: int = 8,
        max_free: int = 4,
        pinned_empty: Callable[[int], torch.Tensor] | None = None,
        new_event: Callable[[], object] | None = None,
        copy: Callable[[torch.Tensor], torch.Tensor] | None = None,
        record: Callable[[object], None] | None = None,
    ) -> None:
        """The keyword hooks stand in for the device in tests (a simulated asynchronous queue)."""
        self.device = device
        self.max_pending = max_pending
        self.max_free = max_free
        self._empty = pinned_empty or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self._new_event = new_event or (lambda: torch.Event(device=device))
        self._copy = copy or (lambda t: t.to(device, non_blocking=True))
        self._record = record or (lambda e: e.record())  # on the current stream: the copy's
        self._free: list[_Slot] = []  # upload buffers no copy reads any more
        self._pending: deque[_Slot] = deque()  # upload buffers whose copy may still run
        self._readback: list[torch.Tensor] = []  # readback buffers their readers gave back
        self._lock = threading.Lock()
        self.counters = {"uploads": 0, "allocations": 0, "waits": 0}

    # -- uploads -------------------------------------------------------------------------------
    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (any CPU tensor) on the device, copied asynchronously through a staging buffer."""
        nbytes = host.numel() * host.element_size()
        with self._lock:
            slot = self._take(nbytes)
            stage = slot.buf[:nbytes].view(host.dtype).view(host.shape)
            stage.copy_(host)
            return self._send(stage, slot)

    def upload_arrays(self, arrays: Sequence[np.ndarray]) -> torch.Tensor:
        """The int64 concatenation of the 1-D ``arrays`` on the device: written straight into a
        staging buffer (no intermediate host array), then copied asynchronously."""
        n = sum(a.size for a in arrays)
        with self._lock:
            slot = self._take(n * 8)
            if n:
                np.concatenate(arrays, out=slot.np64[:n])
            return self._send(slot.t64[:n], slot)

    def _send(self, stage: torch.Tensor, slot: _Slot) -> torch.Tensor:
        dev = self._copy(stage)
        self._record(slot.event)  # after the copy: it fires once the copy has read the buffer
        self._pending.append(slot)
        self.counters["uploads"] += 1
        return dev

    def _take(self, nbytes: int) -> _Slot:
        """A free upload buffer of at least ``nbytes`` (caller holds the lock)."""
        pending = self._pending
        for i in range(len(pending) - 1, -1, -1):  # copies whose event has fired are done reading
            if pending[i].event.query():
                self._free.append(pending[i])
                del pending[i]
        if not self._free and len(pending) >= self.max_pending:
            slot = pending.popleft()
            slot.event.synchronize()  # every buffer is in flight: wait for the oldest copy
            self.counters["waits"] += 1
            self._free.append(slot)
        free = self._free
        if free and free[-1].nbytes >= nbytes:  # the usual case: the buffer the last step used
            return free.pop()
        fits = [i for i, f in enumerate(free) if f.nbytes >= nbytes]
        if fits:
            return free.pop(min(fits, key=lambda j: free[j].nbytes))
        event = free.pop(0).event if free else self._new_event()  # a too-small free buffer is dropped
        del free[self.max_free :]
        return _Slot(self._alloc(nbytes), event)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        self.counters["allocations"] += 1
        return self._empty(_round_up(nbytes))

    # -- readbacks -----------------------------------------------------------------------------
    def readback_buffer(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(pinned host view of ``shape``/``dtype``, its buffer); give the buffer back with
        :meth:`release` once the host has read the view (never before)."""
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            back = self._readback
            if back and back[-1].numel() >= nbytes:
                buf = back.pop()
            else:
                fits = [i for i, b in enumerate(back) if b.numel() >= nbytes]
                buf = back.pop(min(fits, key=lambda j: back[j].numel())) if fits else self._alloc(nbytes)
        view = buf[:nbytes].view(dtype)
        return (view if len(shape) == 1 else view.view(shape)), buf

    def release(self, buf: torch.Tensor) -> None:
        """Give back a readback buffer whose contents the host has read."""
        with self._lock:
            if len(self._readback) < self.max_free:
                self._readback.append(buf)


_stagings: dict[str, HostStaging | None] = {}
_stagings_lock = threading.Lock()


def staging_for(device: torch.device) -> HostStaging | None:
    """The device's staging buffers; None on the CPU or where pinned memory or events are missing."""
    if device.type == "cpu":
        return None
    key = str(device)
    got = _stagings.get(key, False)
    if got is not False:
        return got
    with _stagings_lock:
        if key not in _stagings:
            try:
                probe = torch.empty(1, dtype=torch.uint8, pin_memory=True)
                event = torch.Event(device=device)
                event.record(torch.accelerator.current_stream(device))
                event.synchronize()
                _stagings[key] = HostStaging(device) if probe.is_pinned() else None
            except (RuntimeError, AttributeError, TypeError, ValueError):
                _stagings[key] = None
        return _stagings[key]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without waiting for the device's queued work (a reused
    pinned staging buffer, asynchronous copy). On the CPU the tensor itself is returned."""
    if device.type == "cpu":
        return host
    staging = staging_for(device)
    return host.to(device) if staging is None else staging.upload(host)  # None: no pinned memory, a plain copy


def arrays_to_device(arrays: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """The int64 concatenation of ``arrays`` on ``device``, as :func:`to_device` copies it
    (written straight into the staging buffer on an accelerator)."""
    staging = staging_for(device) if device.type != "cpu" else None
    if staging is None:
        return to_device(torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False)), device)
    return staging.upload_arrays(arrays)
