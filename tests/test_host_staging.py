"""deepinfer_core/staging.py: the reusable pinned buffers of host <-> device copies, against a simulated
asynchronous device (a queue of copies that run only when the test lets the device advance).

The property under test is the one a real GPU would break silently: a staging buffer that an
enqueued copy has not read yet is never written again, so every upload arrives with the values
it was given, however far the host runs ahead. The reference is the uploaded values themselves.
A variant of the staging that ignores the events must fail the same check (the test has teeth).
CPU engines never touch the staging (no pinned memory on the CPU): checked too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_core import staging as staging_mod
from deepinfer_core.staging import HostStaging, arrays_to_device, to_device


class FakeDevice:
    """A device queue: copies and event records run in order, only when ``advance`` says so."""

    def __init__(self):
        self.queue: list = []  # ("copy", src, dst) / ("event", ev)
        self.allocated: list[torch.Tensor] = []

    def empty(self, n):
        t = torch.empty(n, dtype=torch.uint8)
        self.allocated.append(t)
        return t

    def copy(self, src):
        dst = torch.full(src.shape, -7, dtype=src.dtype)  # what the device holds before the copy runs
        self.queue.append(("copy", src, dst))
        return dst

    def record(self, ev):
        ev.done = False
        self.queue.append(("event", ev))

    def advance(self, n=None):
        """Run the next ``n`` queued operations (all by default)."""
        for _ in range(len(self.queue) if n is None else min(n, len(self.queue))):
            op = self.queue.pop(0)
            if op[0] == "copy":
                op[2].copy_(op[1])  # the copy reads its pinned source now, not when it was queued
            else:
                op[1].done = True

    def staging(self, **kw):
        device = self

        class Event:
            done = True

            def query(self):
                return self.done

            def synchronize(self):
                while not self.done:
                    device.advance(1)

        return HostStaging(
            torch.device("cpu"), pinned_empty=self.empty, new_event=Event, copy=self.copy, record=self.record, **kw
        )


def _steps(rng, n):
    return [
        [rng.integers(-1000, 1000, size=int(rng.integers(1, 300))) for _ in range(int(rng.integers(1, 5)))]
        for _ in range(n)
    ]


@pytest.mark.parametrize("lag", [0, 1, 3, 50])
def test_uploads_arrive_intact_however_far_the_host_runs_ahead(lag):
    """The device runs ``lag`` operations behind; the host keeps uploading steps of varying size."""
    dev = FakeDevice()
    st = dev.staging(max_pending=4)
    rng = np.random.default_rng(lag)
    sent = []
    for arrays in _steps(rng, 40):
        out = st.upload_arrays(arrays) if len(arrays) > 1 else st.upload(torch.from_numpy(arrays[0]))
        sent.append((np.concatenate(arrays), out))
        if len(dev.queue) > lag:
            dev.advance(len(dev.queue) - lag)
    dev.advance()
    for want, got in sent:
        assert got.tolist() == want.tolist()
    assert st.counters["uploads"] == 40
    assert st.counters["allocations"] <= 10  # reused, not one buffer per step (sizes grow to 4 KiB..)


def test_buffers_are_reused_once_their_copies_ran_and_waited_for_when_all_are_in_flight():
    dev = FakeDevice()
    st = dev.staging(max_pending=3)
    for i in range(10):  # the device keeps up: one buffer serves every step
        st.upload(torch.full((100,), i, dtype=torch.int64))
        dev.advance()
    assert st.counters["allocations"] == 1 and st.counters["waits"] == 0
    outs = [st.upload(torch.full((100,), i, dtype=torch.int64)) for i in range(5)]  # the device stalls
    assert (
        st.counters["allocations"] == 3 and st.counters["waits"] == 2
    )  # 3 in flight at most, then the oldest is waited for
    dev.advance()
    assert [o[0].item() for o in outs] == list(range(5))
    big = st.upload(torch.arange(5000, dtype=torch.int64))  # grown past every buffer
    dev.advance()
    assert big.tolist() == list(range(5000)) and st.counters["allocations"] == 4


def test_the_check_fails_when_the_staging_ignores_its_events(monkeypatch):
    """Teeth: a staging that treats every copy as finished overwrites pending sources."""
    dev = FakeDevice()
    st = dev.staging(max_pending=4)
    sent = []
    for i in range(6):
        sent.append((i, st.upload(torch.full((64,), i, dtype=torch.int64))))
        for slot in st._pending:
            slot.event.done = True  # the broken staging's view: nothing is in flight
    dev.advance()
    assert [o[0].item() for _, o in sent] != [i for i, _ in sent]


def test_readback_buffers_are_reused_only_after_release():
    dev = FakeDevice()
    st = dev.staging()
    a, abuf = st.readback_buffer(torch.Size([8]), torch.int64)
    b, bbuf = st.readback_buffer(torch.Size([8]), torch.int64)
    assert abuf.data_ptr() != bbuf.data_ptr()  # a is not given back yet
    st.release(abuf)
    c, cbuf = st.readback_buffer(torch.Size([5]), torch.int64)
    assert cbuf.data_ptr() == abuf.data_ptr() and c.shape == (5,)


def test_cpu_copies_touch_no_staging(monkeypatch):
    monkeypatch.setattr(staging_mod, "HostStaging", None)  # any use would raise
    t = torch.arange(6)
    assert to_device(t, torch.device("cpu")) is t
    got = arrays_to_device([np.arange(3), np.arange(3, 6, dtype=np.int32)], torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == list(range(6))
    assert staging_mod.staging_for(torch.device("cpu")) is None


# -- on a CUDA device: the real staging under a stalled stream (skipped without one) -----------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STALL = 20_000_000  # GPU clock cycles (~10 ms on an H200): copies queue up behind it


@cuda
@pytest.mark.parametrize("broken", [False, True], ids=["events", "events-ignored"])
def test_cuda_uploads_behind_a_stalled_stream_arrive_intact(broken):
    """The stream sleeps, then 24 uploads of varying size are queued behind it; each must arrive
    with its own values. With the events ignored (``broken``) the staging reuses buffers that
    pending copies still read, and the same check must fail: the race is real and caught."""
    device = torch.device("cuda")

    class IgnoredEvent:  # recorded like the real one, but says every copy has finished
        def __init__(self):
            self.event = torch.Event(device=device)

        def record(self, stream=None):
            self.event.record(stream)

        def query(self):
            return True

        def synchronize(self):
            pass

    st = HostStaging(device, max_pending=32, **({"new_event": IgnoredEvent} if broken else {}))
    rng = np.random.default_rng(0)
    torch.cuda._sleep(STALL)
    sent = []
    for i in range(24):
        a = np.full(int(rng.integers(1, 2000)), i, np.int64)
        sent.append((a, st.upload_arrays([a[:5], a[5:]]) if i % 2 else st.upload(torch.from_numpy(a))))
    torch.cuda.synchronize()
    ok = all(got.cpu().tolist() == want.tolist() for want, got in sent)
    assert ok != broken


@cuda
def test_cuda_overlapped_steps_with_stalled_copies_equal_serial_steps(tmp_path, monkeypatch):
    """Every batch build stalls the stream before its upload, so overlapped scheduling builds
    step N+1 (and N+2) while earlier uploads still wait to read their staging buffers; greedy and
    seeded tokens must equal the engine without overlap (no stall)."""
    transformers = pytest.importorskip("transformers")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.engine import model_runner

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12] * 30, [13], [20, 21] * 7, [30] * 40, list(range(2, 90)) * 2]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=10, seed=4, max_tokens=33),
              SamplingParams(temperature=0, max_tokens=25),
              SamplingParams(temperature=0.7, top_p=0.8, seed=1, max_tokens=37, min_tokens=5),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[50, 51, 52]),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]  # fmt: skip
    kw = dict(device="cuda", dtype="float32", kv_cache_blocks=32, max_num_seqs=4, max_num_batched_tokens=64)
    off = LLM(str(tmp_path), overlap_scheduling=False, **kw)
    want = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in off.generate(prompts, params)]
    on = LLM(str(tmp_path), **kw)
    assert on.engine.overlap
    build = model_runner.build
    monkeypatch.setattr(model_runner, "build", lambda *a, **k: torch.cuda._sleep(STALL // 10) or build(*a, **k))
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in on.generate(prompts, params)]
    assert got == want
