"""Pruning of compiled helpers cached per source version (``deepinfer_core.build_cache``): the
most recently used versions are kept, one another process is loading is never removed, and the
low-bit kernels' real build prunes the versions before it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deepinfer_core import build_cache


def _builds(directory, names_and_ages):
    """Files named as given, each last used ``age`` hours ago."""
    paths = {}
    for name, age in names_and_ages:
        path = directory / name
        path.write_bytes(b"\x7fELF not really")
        stamp = path.stat().st_mtime - age * 3600
        os.utime(path, (stamp, stamp))
        paths[name] = path
    return paths


def test_prune_keeps_the_most_recently_used(tmp_path):
    _builds(
        tmp_path, [("lowbit-a.so", 5), ("lowbit-b.so", 1), ("lowbit-c.so", 9), ("lowbit-d.so", 2), ("other.so", 99)]
    )
    removed = build_cache.prune(str(tmp_path), "lowbit-*.so", keep=2)
    assert sorted(os.path.basename(p) for p in removed) == ["lowbit-a.so", "lowbit-c.so"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lowbit-b.so", "lowbit-d.so", "other.so"]


def test_a_load_marks_the_file_used(tmp_path):
    paths = _builds(tmp_path, [("lowbit-old.so", 9), ("lowbit-new.so", 1)])
    with build_cache.loading(str(paths["lowbit-old.so"])) as present:
        assert present
    build_cache.prune(str(tmp_path), "lowbit-*.so", keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["lowbit-old.so"]


def test_a_file_being_loaded_is_not_removed(tmp_path):
    """flock: the pruner's exclusive lock fails while a loader holds its shared one (separate
    open file descriptions conflict even inside one process)."""
    paths = _builds(tmp_path, [("lowbit-a.so", 9), ("lowbit-b.so", 1)])
    held = str(paths["lowbit-a.so"])
    with build_cache.loading(held) as present:
        assert present
        os.utime(held, (0, 0))  # the oldest again: pruning would take it
        assert build_cache.prune(str(tmp_path), "lowbit-*.so", keep=1) == []
        assert os.path.exists(held)
    assert build_cache.prune(str(tmp_path), "lowbit-*.so", keep=1) == [held]


def test_loading_a_missing_or_replaced_file(tmp_path):
    with build_cache.loading(str(tmp_path / "lowbit-none.so")) as present:
        assert not present
    path = tmp_path / "lowbit-x.so"
    path.write_bytes(b"old")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.replace(_builds(tmp_path, [("new.so", 0)])["new.so"], path)  # another builder replaced it
        assert not build_cache._same_file(fd, str(path))
    finally:
        os.close(fd)


BUILD = r"""
from deepinfer_core.lowbit import native
kernels = native.load()
print(kernels.reason or "loaded")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="flock and the C build are POSIX")
def test_a_new_build_prunes_older_versions_but_not_one_in_use(tmp_path):
    """The real low-bit build in a child process (a fresh cache: it compiles) with four stale
    versions present, one of them held by this process as if it were loading it."""
    from deepinfer_core.lowbit.native import compiler_path, cpu_supports_kernels

    if compiler_path() is None or not cpu_supports_kernels()[0]:
        pytest.skip("no C compiler or no AVX2: nothing is built")
    cache = tmp_path / "deepinfer"
    cache.mkdir()
    stale = _builds(
        cache,
        [
            ("lowbit-0000000000000001.so", 1),
            ("lowbit-0000000000000002.so", 2),
            ("lowbit-0000000000000003.so", 3),
            ("lowbit-0000000000000004.so", 4),
        ],
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    with build_cache.loading(str(stale["lowbit-0000000000000004.so"])):
        os.utime(stale["lowbit-0000000000000004.so"], (0, 0))
        result = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert result.stdout.strip() == "loaded", result.stderr[-2000:]
    left = sorted(p.name for p in cache.iterdir())
    built = [name for name in left if name not in stale]
    assert len(built) == 1 and built[0].startswith("lowbit-")
    # kept: the new build and the two most recently used before it; the held one survives
    assert left == sorted(
        [built[0], "lowbit-0000000000000001.so", "lowbit-0000000000000002.so", "lowbit-0000000000000004.so"]
    )


def test_a_failed_build_is_reported_and_leaves_no_files(tmp_path, monkeypatch):
    """A source that does not compile: load_isa answers with the compiler's message (callers fall
    back to float weights) and the cache directory holds no half-built library or object files."""
    from deepinfer_core.lowbit import native

    if native.compiler_path() is None or not native.cpu_supports_kernels()[0]:
        pytest.skip("no C compiler or no AVX2: nothing is built")
    broken = tmp_path / "broken.c"
    broken.write_text("int lowbit_isa(void) { return undeclared_name; }\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_SOURCES", (native._SOURCES[0], str(broken)))
    kernels = native.load_isa.__wrapped__("avx2")
    assert kernels.lib is None
    assert "failed" in kernels.reason and "undeclared_name" in kernels.reason
    assert list((tmp_path / "cache" / "deepinfer").iterdir()) == []
