"""A stand-in for ``hf3fs_fuse.io`` with the same calls, doing the I/O with pread/pwrite.

It checks the rules the real client enforces (an fd must be registered, a ring only does the
direction it was made for, at most ``entries`` prepared I/Os, the iovec's mount matches) so
that a store misusing USRBIO fails here too.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any


class MockIovec:
    """A window on the shared-memory buffer; slicing gives a sub-window (like the real iov)."""

    def __init__(self, buf: memoryview, start: int = 0, stop: int | None = None) -> None:
        self.buf, self.start, self.stop = buf, start, len(buf) if stop is None else stop

    def __getitem__(self, item: slice) -> "MockIovec":
        start, stop, step = item.indices(self.stop - self.start)
        assert step == 1
        return MockIovec(self.buf, self.start + start, self.start + stop)

    def view(self) -> memoryview:
        return self.buf[self.start : self.stop]


@dataclass
class MockResult:
    result: int
    userdata: Any = None


class MockIoring:
    def __init__(self, client: "MockUsrbioClient", entries: int, for_read: bool) -> None:
        self.client, self.entries, self.for_read = client, entries, for_read
        self.pending: list[tuple[MockIovec, int, int, Any]] = []

    def prepare(self, iov: MockIovec, read: bool, fd: int, offset: int, userdata: Any = None) -> None:
        assert read == self.for_read, "ring used for the wrong direction"
        assert fd in self.client.registered, "fd not registered with register_fd"
        assert len(self.pending) < self.entries, "ring full"
        self.pending.append((iov, fd, offset, userdata))

    def submit(self) -> "MockIoring":
        return self

    def wait(self, min_results: int = 1) -> list[MockResult]:
        assert len(self.pending) >= min_results
        results = []
        for iov, fd, offset, userdata in self.pending:
            if self.client.fail_with is not None:
                results.append(MockResult(-self.client.fail_with, userdata))
                continue
            view = iov.view()
            if self.for_read:
                done = os.preadv(fd, [view], offset)
                self.client.ops["read"] += 1
            else:
                if self.client.short_writes:  # a write that stops one byte short, errno-less
                    view = view[:-1]
                done = os.pwrite(fd, view, offset)
                self.client.ops["write"] += 1
            results.append(MockResult(done, userdata))
        self.pending.clear()
        return results


class MockUsrbioClient:
    """Module-like object: ``make_iovec``, ``make_ioring``, ``register_fd``, ``deregister_fd``."""

    def __init__(self, mount: str) -> None:
        self.mount = mount
        self.registered: set[int] = set()
        self.ops: Counter[str] = Counter()
        self.fail_with: int | None = None  # an errno every I/O returns (negated), when set
        self.short_writes = False  # when set, writes report one byte less and no error

    def make_iovec(self, shm, mount: str, block_size: int = 0, numa: int = -1) -> MockIovec:
        assert mount == self.mount, f"iovec for {mount}, client mounted at {self.mount}"
        return MockIovec(shm.buf)

    def make_ioring(self, mount: str, entries: int, for_read: bool, io_depth: int = 0) -> MockIoring:
        assert mount == self.mount
        return MockIoring(self, entries, for_read)

    def register_fd(self, fd: int) -> None:
        assert fd not in self.registered
        self.registered.add(fd)

    def deregister_fd(self, fd: int) -> None:
        self.registered.remove(fd)
