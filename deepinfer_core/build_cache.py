"""Compiled helpers cached per source version (``~/.cache/deepinfer/lowbit-<hash>.so``, the V4
parser's ``native/v4quiet-<hash>.so``): loading one safely while another process prunes, and
pruning the versions nobody has used lately.

Every change to a C source gives a new file name, so without pruning one shared object piles
up per version ever run. Pruning happens when a process builds a new version, and keeps the
``keep`` most recently *used* ones (a load refreshes the file's mtime), so two installed
versions used side by side do not delete each other's build on every start.

Safety with concurrent processes (POSIX ``flock``): a loader holds a shared lock on the file
from before it checks the file is there until ``dlopen`` has mapped it (after that an unlink
cannot hurt it: the mapping keeps the inode). The pruner unlinks a file only while holding an
exclusive lock it got without waiting, so it never removes a file between a loader's check and
its ``dlopen``; a file it cannot lock is left for the next pruning. A loader whose file was
unlinked between its ``open`` and its lock sees a different inode at the path and builds again,
as it would for a missing file. Reusable by plugins (docs/writing-plugins.md).
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Iterator

try:
    import fcntl
except ImportError:  # not POSIX: loads go unlocked and nothing is pruned
    fcntl = None  # type: ignore[assignment]

__all__ = ["KEEP", "loading", "prune"]


KEEP = 3  # versions kept: the one just built and the two used most recently before it


@contextlib.contextmanager
def loading(path: str) -> Iterator[bool]:
    """Hold ``path`` against pruning while it is loaded; yields whether it is there to load.

    Marks it as used (mtime) so that pruning keeps it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield False
        return
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        present = _same_file(fd, path)
        if present:
            with contextlib.suppress(OSError):  # a read-only cache still loads
                os.utime(path)
        yield present
    finally:
        os.close(fd)  # releases the lock


def prune(directory: str, pattern: str, keep: int = KEEP) -> list[str]:
    """Remove all but the ``keep`` most recently used files matching ``pattern`` (a glob, e.g.
    ``lowbit-*.so``) in ``directory``, skipping any that a process is loading; returns the
    paths removed. Errors are swallowed: pruning is housekeeping, never a reason to fail."""
    if fcntl is None or keep < 1:
        return []
    candidates = []
    for path in glob.glob(os.path.join(glob.escape(directory), pattern)):
        with contextlib.suppress(OSError):
            candidates.append((os.stat(path).st_mtime, path))
    candidates.sort(reverse=True)
    removed = []
    for _, path in candidates[keep:]:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError (an OSError): in use, keep
                if _same_file(fd, path):
                    os.unlink(path)
                    removed.append(path)
            finally:
                os.close(fd)
    return removed


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not unlinked or replaced since)."""
    try:
        held, named = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
