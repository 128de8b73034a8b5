"""Scheduler invariants, driven without a model (tokens are fed back by the test)."""

from deepinfer_core.engine.kv_cache_manager import KVCacheManager
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


def drive(sched: Scheduler, max_new: int, max_steps: int = 500):
    """Run to completion, sampling token 7 each time; return the step outputs."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        steps.append(out)
        sampled = {s.request_id: 7 for s in out.requests if s.sample}
        for req in sched.update(out, sampled):
            if len(req.output_token_ids) >= max_new:
                sched.finish(req, "length")
    return steps


def test_budget_and_chunked_prefill():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, long_prefill_threshold=10),
        KVCacheManager(64, BS, "ns"),
    )
    sched.add(Request("a", list(range(25)), SamplingParams(), 0))
    steps = drive(sched, max_new=3)
    assert all(s.num_tokens <= 10 for s in steps)
    first = [s.requests[0] for s in steps[:3]]
    assert [len(r.token_ids) for r in first] == [10, 10, 5]
    assert [r.start_position for r in first] == [0, 10, 20]
    assert [r.sample for r in first] == [False, False, True]


def test_decode_and_prefill_share_a_step():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(64, BS, "ns"))
    sched.add(Request("a", [1, 2, 3], SamplingParams(), 0))
    out = sched.schedule()
    sched.update(out, {"a": 5})
    sched.add(Request("b", [4, 5, 6, 7, 8], SamplingParams(), 0))
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.requests] == [("a", 1), ("b", 5)]


def test_preemption_when_blocks_run_out_and_everyone_finishes():
    kv = KVCacheManager(6, BS, "ns")
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    for i in range(3):
        sched.add(Request(f"r{i}", list(range(i * 10, i * 10 + 6)), SamplingParams(), 0))
    drive(sched, max_new=6)
    assert sched.num_preemptions > 0
    assert not sched.has_unfinished() and kv.pool.num_free == 6


def test_max_num_seqs_limits_running():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), KVCacheManager(64, BS, "ns"))
    for i in range(5):
        sched.add(Request(f"r{i}", [i + 1, 2, 3], SamplingParams(), 0))
    out = sched.schedule()
    assert len(out.requests) == 2 and len(sched.waiting) == 3


def test_abort_frees_blocks():
    kv = KVCacheManager(8, BS, "ns")
    sched = Scheduler(SchedulerConfig(), kv)
    sched.add(Request("a", list(range(9)), SamplingParams(), 0))
    sched.schedule()
    assert kv.pool.num_free < 8
    sched.abort("a")
    assert kv.pool.num_free == 8 and not sched.has_unfinished()


def test_token_slice_is_the_slice_of_prompt_plus_output():
    """Request.token_slice (the scheduler's and the prefix-cache keys' way to read a window of
    a request's tokens without copying its history) equals slicing the concatenated list."""
    req = Request("a", [10, 11, 12, 13, 14], SamplingParams(), 0)
    req.output_token_ids.extend([20, 21, 22])
    whole = [10, 11, 12, 13, 14, 20, 21, 22]
    for start in range(len(whole) + 2):
        for end in range(start, len(whole) + 3):
            assert req.token_slice(start, end) == whole[start:end], (start, end)


def test_prompt_chunks_carry_their_ids_as_array_views_and_build_the_same_batch():
    """A request whose prompt came with an array (the entry check makes one) is scheduled with
    views of it for prompt chunks (None once the step reaches output tokens); the batch built
    from them has the input ids, positions and slots of the batch built from the token ids."""
    import dataclasses

    import numpy as np
    import torch

    from deepinfer_core.engine.batch_build import build

    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, long_prefill_threshold=10),
        KVCacheManager(64, BS, "ns"),
    )
    prompt = [(37 * i) % 101 for i in range(25)]
    sched.add(Request("a", list(prompt), SamplingParams(), 0, prompt_array=np.array(prompt, dtype=np.uint32)))
    sched.add(Request("b", [5, 6, 7], SamplingParams(), 0))  # no array: its rows come from token_ids
    steps = drive(sched, max_new=3)
    seen = 0
    for out in steps:
        for s in out.requests:
            if s.request_id == "a" and s.start_position + len(s.token_ids) <= len(prompt):
                assert s.token_array.tolist() == list(s.token_ids)
                seen += 1
            else:
                assert s.token_array is None
        plain = dataclasses.replace(out, requests=tuple(dataclasses.replace(s, token_array=None) for s in out.requests))
        a, b = build(out, BS, torch.device("cpu")), build(plain, BS, torch.device("cpu"))
        assert torch.equal(a.input_ids, b.input_ids) and a.input_ids.dtype == torch.int64
        assert torch.equal(a.meta.positions, b.meta.positions) and torch.equal(a.meta.slot_mapping, b.meta.slot_mapping)
    assert seen == 3  # 10 + 10 + 5 prompt tokens
