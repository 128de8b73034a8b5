"""Acceptance of the persistent KV cache across processes (issue 9), on a tiny random Llama
checkpoint whose greedy tokens come from transformers (the independent reference).

Every engine here runs in its own process where the point is a process boundary: a restart
(process A writes, process B reads), two writers at once, a writer killed between write and
commit. Expiry and the operator CLI (``deepinfer kv ...``) are driven through real subprocesses
and real time (a store URL with a 2-second retention), not a patched clock.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.kv_store import KVStoreConfig
from deepinfer_core.kv_store.local import LocalDiskKVStore, stored_namespaces
from deepinfer_core.kv_store.records import payload_offset

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

BS = 128
LONG = 4096  # the acceptance prompt: 31 full blocks servable (3968 tokens, 96.9%)
SHORT = 1024  # 7 full blocks servable (896 tokens)
NEW = 12

CHILD = r"""
import hashlib, json, os, signal, sys, time
from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.request import Request
cfg = json.loads(sys.argv[1])
llm = LLM(cfg["model"], device="cpu", dtype="float32", kv_cache_blocks=40, kv_store=cfg["url"])
store = llm.engine.tiers.store
if cfg.get("die") == "before_commit":  # every temp record complete, none committed
    real_write = store.write_from
    def write_then_die(ticket, buffers):
        real_write(ticket, buffers)
        os.kill(os.getpid(), signal.SIGKILL)
    store.write_from = write_then_die
elif cfg.get("die") == "mid_write":  # the first temp record half written
    def half_then_die(path, parts):
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data[: len(data) // 2])
        os.fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    store.io.write_file = half_then_die
if cfg.get("barrier"):
    open(cfg["barrier"] + "." + str(os.getpid()), "w").close()
    while not os.path.exists(cfg["barrier"]):
        time.sleep(0.005)
out = llm.generate([cfg["prompt"]], SamplingParams(temperature=0, max_tokens=cfg["new"], ignore_eos=True))[0]
llm.engine.tiers.flush()
req = Request("keys", list(cfg["prompt"]), SamplingParams(), seed=0)
llm.engine.kv._update_keys(req)
host = llm.engine.tiers.host
digests = {k.hex(): hashlib.sha256(bytes(host.get(k).numpy())).hexdigest()
           for k in req.block_keys if host.get(k) is not None}
stats = llm.engine.stats()["kv_tiers"]
print(json.dumps({"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens, "digests": digests,
                  "loaded": stats.get("store_blocks_loaded", 0), "written": stats.get("blocks_written", 0)}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random 2-layer Llama with a 4.5K context, and transformers' greedy tokens for the
    long and short prompts."""
    path = tmp_path_factory.mktemp("tiny-llama-4k")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4608, initializer_range=0.1, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(path)
    gen = torch.Generator().manual_seed(7)
    prompts = {n: torch.randint(2, 512, (n,), generator=gen).tolist() for n in (LONG, SHORT)}
    refs = {}
    with torch.no_grad():
        for n, ids in prompts.items():
            out = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, n, dtype=torch.long),
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=None,
            )
            refs[n] = out[0, n:].tolist()
    return str(path), prompts, refs


def child(model_dir: str, url: str, prompt: list[int], **extra) -> subprocess.Popen:
    cfg = {"model": model_dir, "url": url, "prompt": prompt, "new": NEW, **extra}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def result(proc: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def run_child(model_dir: str, url: str, prompt: list[int], **extra) -> dict:
    return result(child(model_dir, url, prompt, **extra))


def files(root, suffix: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(suffix))


def open_namespace(root) -> LocalDiskKVStore:
    [(namespace, block_bytes)] = stored_namespaces(root)
    return LocalDiskKVStore(KVStoreConfig(namespace=namespace, block_bytes=block_bytes, path=str(root)))


def payload_digest(path: str, key_hex: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()[payload_offset(bytes.fromhex(key_hex)) :]).hexdigest()


def deepinfer_kv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer_core.entrypoints", "kv", *args], capture_output=True, text=True, timeout=300
    )


def deepinfer_kv_here(capsys, *args: str) -> tuple[int, str, str]:
    """The same command through ``deepinfer_core.entrypoints.main.main`` in this process (cheaper)."""
    from deepinfer_core.entrypoints.main import main

    capsys.readouterr()
    code = main(["kv", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def tiny(model_dir: str, url: str) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", kv_cache_blocks=40, kv_store=url)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def serve_here(model_dir: str, url: str, prompt: list[int]):
    llm = tiny(model_dir, url)
    out = llm.generate([prompt], GREEDY)[0]
    llm.engine.tiers.flush()
    return out, llm


# -- process A writes, process B reads -----------------------------------------------------------
def test_a_4k_prompt_prefilled_in_one_process_is_served_from_the_store_in_the_next(model, tmp_path, capsys):
    model_dir, prompts, refs = model
    url = f"local://{tmp_path / 'store'}"
    a = run_child(model_dir, url, prompts[LONG])
    assert a["cached"] == 0 and a["tokens"] == refs[LONG]
    assert a["written"] == 32  # every full block of prompt + output (4108 tokens)
    b = run_child(model_dir, url, prompts[LONG])
    assert b["cached"] == 31 * BS >= 0.9 * LONG
    assert b["loaded"] == 31
    assert b["tokens"] == refs[LONG]
    # the operator's view, from a third process, counts what both did (issue 31.7: it said 0 hits)
    code, out, _ = deepinfer_kv_here(capsys, "stats", "--kv-store", url)
    [row] = json.loads(out)
    assert code == 0 and (row["processes"], row["commits"], row["hits"], row["misses"]) == (2, 32, 31, 0)


# -- two engines write the same blocks at once ---------------------------------------------------
def test_two_engine_processes_writing_the_same_blocks_at_once(model, tmp_path):
    model_dir, prompts, refs = model
    root = tmp_path / "store"
    url = f"local://{root}"
    barrier = str(tmp_path / "go")
    writers = [child(model_dir, url, prompts[SHORT], barrier=barrier) for _ in range(2)]
    deadline = time.monotonic() + 300
    while len([f for f in os.listdir(tmp_path) if f.startswith("go.")]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    open(barrier, "w").close()  # both engines are loaded: prefill and write back together
    a, b = (result(w) for w in writers)
    assert a["tokens"] == b["tokens"] == refs[SHORT]
    assert a["digests"] == b["digests"] and len(a["digests"]) == 8  # same bytes computed by both
    records = files(root, ".kv")
    assert len(records) == 8 and files(root, ".tmp") == []  # one record per block, no leftovers
    store = open_namespace(root)
    for key_hex, digest in a["digests"].items():  # each record verifies and holds those bytes
        path = store.record_path(bytes.fromhex(key_hex))
        assert path is not None and payload_digest(path, key_hex) == digest
    out, reader = serve_here(model_dir, url, prompts[SHORT])
    assert out.num_cached_tokens == 7 * BS and out.outputs[0].token_ids == refs[SHORT]
    assert reader.engine.stats()["kv_tiers"]["store_blocks_loaded"] == 7


# -- a process killed between write and commit -----------------------------------------------------
@pytest.mark.parametrize("die", ["before_commit", "mid_write"])
def test_a_process_killed_between_write_and_commit_leaves_nothing_servable(model, tmp_path, die):
    model_dir, prompts, refs = model
    root = tmp_path / "store"
    url = f"local://{root}"
    killed = child(model_dir, url, prompts[SHORT], die=die)
    killed.communicate(timeout=600)
    assert killed.returncode == -9
    assert files(root, ".kv") == [] and len(files(root, ".tmp")) >= 1  # written, never committed
    after, llm = serve_here(model_dir, url, prompts[SHORT])
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == refs[SHORT]
    assert llm.engine.stats()["kv_tiers"].get("store_blocks_loaded", 0) == 0
    store = open_namespace(root)  # the abandoned temp files go once their reservation is over
    assert store.gc(now=time.time() + 3600) >= 1 and files(root, ".tmp") == []
    again, _ = serve_here(model_dir, url, prompts[SHORT])
    assert again.num_cached_tokens == 7 * BS and again.outputs[0].token_ids == refs[SHORT]


# -- retention, and the operator CLI -------------------------------------------------------------
def test_expired_blocks_are_not_served_and_kv_gc_removes_them(model, tmp_path, capsys):
    model_dir, prompts, refs = model
    root = tmp_path / "store"
    _, writer = serve_here(model_dir, f"local://{root}?retention_seconds=chat:2", prompts[SHORT])
    assert len(files(root, ".kv")) == 8 and writer.engine.tiers.store.stats()["blocks"] == 8
    time.sleep(3)  # past the 2-second retention
    # What happens: a lookup hides an expired block at once and deletes nothing ...
    keys = [bytes.fromhex(os.path.basename(p)[:-3]) for p in files(root, ".kv")]
    assert writer.engine.tiers.store.match_prefix(keys) == 0 and len(files(root, ".kv")) == 8
    code, out, _ = deepinfer_kv_here(capsys, "stats", "--kv-store", f"local://{root}")
    assert code == 0 and [(s["blocks"], s["expired_not_deleted"]) for s in json.loads(out)] == [(0, 8)]
    # ... `deepinfer kv gc` deletes the files
    gc = deepinfer_kv("gc", "--kv-store", f"local://{root}", "--json")
    assert gc.returncode == 0, gc.stderr
    assert [row["removed"] for row in json.loads(gc.stdout)] == [8]
    assert files(root, ".kv") == []
    # and a new engine computes the prompt again (same tokens), writing it back for 7 days
    out, _ = serve_here(model_dir, f"local://{root}", prompts[SHORT])
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == refs[SHORT]
    code, out, _ = deepinfer_kv_here(capsys, "ls", "--kv-store", f"local://{root}")
    assert code == 0 and "       8 blocks" in out, out


def test_an_expired_block_is_written_again_by_the_engine_that_hid_it(model, tmp_path):
    model_dir, prompts, refs = model
    root = tmp_path / "store"
    serve_here(model_dir, f"local://{root}?retention_seconds=chat:2", prompts[SHORT])
    time.sleep(3)
    out, second = serve_here(model_dir, f"local://{root}", prompts[SHORT])  # its index knows the blocks expired
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == refs[SHORT]
    assert second.engine.tiers.store.stats()["blocks"] == 8 and len(files(root, ".kv")) == 8  # replaced
    third, _ = serve_here(model_dir, f"local://{root}", prompts[SHORT])
    assert third.num_cached_tokens == 7 * BS and third.outputs[0].token_ids == refs[SHORT]


def test_an_expired_block_is_written_again_by_the_engine_that_wrote_it(model, tmp_path):
    """The writer's "already stored" memo lasts only as long as the record: the engine that
    wrote a block writes it again once its record expired, whether the block comes back as a
    device hit or is computed again after the device cache lost it; a fresh engine is then
    served from the rewritten records. Rewrites use the 3-day "agent" class, so only the
    first writes expire during the test (2 seconds)."""
    model_dir, prompts, refs = model
    llm = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        kv_cache_blocks=12,
        kv_host_pool_gib=1e-6,
        kv_store=f"local://{tmp_path}?retention_seconds=chat:2",
    )  # host pool: 1 block
    store = llm.engine.tiers.store
    short, other = prompts[SHORT], prompts[LONG][:SHORT]
    agent = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, kv_retention="agent")

    def serve(prompt, params=GREEDY):
        out = llm.generate([prompt], params)[0]
        llm.engine.tiers.flush()
        return out

    assert serve(short).num_cached_tokens == 0 and store.stats()["blocks"] == 8
    time.sleep(3)  # past the 2-second retention
    assert store.stats()["blocks"] == 0 and store.stats()["expired_not_deleted"] == 8
    again = serve(short, agent)  # 7 device hits (the 8th block computed)
    assert again.num_cached_tokens == 7 * BS and again.outputs[0].token_ids == refs[SHORT]
    assert store.stats()["blocks"] == 8 and store.stats()["expired_not_deleted"] == 0  # rewritten
    other_tokens = serve(other).outputs[0].token_ids  # 2-second records; evicts short's device blocks
    time.sleep(3)
    assert serve(short).num_cached_tokens == 7 * BS  # from the store (rewritten): evicts other's
    recomputed = serve(other, agent)
    assert recomputed.num_cached_tokens < 7 * BS and recomputed.outputs[0].token_ids == other_tokens
    assert store.stats()["blocks"] == 16 and store.stats()["expired_not_deleted"] == 0
    fresh = tiny(model_dir, f"local://{tmp_path}").generate([other], GREEDY)[0]
    assert fresh.num_cached_tokens == 7 * BS and fresh.outputs[0].token_ids == other_tokens


def test_kv_cli_ls_stats_gc_through_subprocess(model, tmp_path, capsys):
    model_dir, prompts, refs = model
    root = tmp_path / "store"
    url = f"local://{root}"
    serve_here(model_dir, url, prompts[SHORT])
    [(namespace, block_bytes)] = stored_namespaces(root)
    assert block_bytes == 2 * 2 * BS * 2 * 16 * 4  # layers x (K, V) x tokens x KV heads x head dim x float32
    ls = deepinfer_kv("ls", "--kv-store", url)
    assert (
        ls.returncode == 0
        and ls.stdout.split()[:3] == [namespace[:16], "8", "blocks"]
        and f"block {block_bytes} B" in ls.stdout
    )
    stats = deepinfer_kv("stats", "--kv-store", url)
    assert stats.returncode == 0, stats.stderr
    [row] = json.loads(stats.stdout)
    assert (row["namespace"], row["blocks"], row["block_bytes"]) == (namespace, 8, block_bytes) and row[
        "path"
    ].startswith(str(root))
    assert row["bytes"] == sum(os.path.getsize(p) for p in files(root, ".kv"))
    # --kv-store-gib trims to 3 blocks: the chain's tail goes first, its head stays servable
    gib = 3.5 * block_bytes / 2**30
    gc = deepinfer_kv("gc", "--kv-store", url, "--kv-store-gib", str(gib), "--json")
    assert gc.returncode == 0, gc.stderr
    [row] = json.loads(gc.stdout)
    assert (row["blocks"], row["evictions"], row["removed"]) == (3, 5, 0)
    again, _ = serve_here(model_dir, url, prompts[SHORT])
    assert again.num_cached_tokens == 3 * BS and again.outputs[0].token_ids == refs[SHORT]
    code, _, err = deepinfer_kv_here(capsys, "ls", "--kv-store", "nosuch:///x")
    assert code == 2 and "installed backends" in err and "local" in err
    code, out, _ = deepinfer_kv_here(capsys, "ls", "--kv-store", f"local://{tmp_path / 'empty'}")
    assert code == 0 and "no namespaces" in out


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_capacity_eviction_takes_expired_blocks_first_then_the_least_recently_used(tmp_path, backend):
    from deepinfer_core.kv_store.memory import MemoryKVStore

    config = KVStoreConfig(
        namespace="ns", block_bytes=64, path=str(tmp_path), capacity_blocks=3, options={"retention_seconds": "agent:1"}
    )
    store = LocalDiskKVStore(config) if backend == "local" else MemoryKVStore(config)

    def put(i: int, retention: str = "chat") -> None:
        ticket = store.reserve_write([bytes([i]) * 16], retention)
        store.write_from(ticket, [memoryview(bytes([i]) * 64)])
        assert store.commit(ticket, [True]) == 1

    def visible() -> list[int]:
        return [i for i in range(1, 6) if store.match_prefix([bytes([i]) * 16]) == 1]

    put(1)
    put(2)
    put(3, "agent")  # the most recently used, but expires in a second
    time.sleep(1.2)
    assert visible() == [1, 2]
    put(4)  # over capacity: the expired block goes, not block 1 (the least recently used)
    assert visible() == [1, 2, 4] and store.stats()["blocks"] == 3
    lease = store.acquire_read([bytes([1]) * 16])  # block 1 is used: block 2 is now the LRU one
    store.release(lease)
    put(5)
    assert visible() == [1, 4, 5]
    if backend == "local":
        assert len(files(tmp_path, ".kv")) == 3
