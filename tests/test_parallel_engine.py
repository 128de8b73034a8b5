"""Expert parallelism and attention data parallelism across real rank processes (gloo, CPU).

Tiny float32 DeepSeek-V3 and V4 checkpoints from random weights; the single-process engine
(EP=1, whose tokens the DeepSeek tests pin to transformers) is the reference. Each parallel
engine is a set of spawned processes exchanging routed tokens with all_to_all; their greedy
tokens must equal the reference's token for token: with EP=2 and EP=4, with DP=2 x EP=2, across
expert re-placements (a forced table and EPLB's periodic plan), and while one rank has no
requests at all (it runs empty steps). A rank killed mid-step fails every request with an error
within the collective timeout, and the process driving the group exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytest.importorskip("transformers")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.testing.v3_checkpoint import TINY_V3_CONFIG, tiny_deepseek_v3  # noqa: E402
from deepinfer_core.testing.v4_tiny import TINY_V4_KWARGS, save_tiny_v4  # noqa: E402

pytestmark = pytest.mark.slow  # several process groups (~5-15 s each on a 2-core machine)
NEW = 10
COMMON = dict(device="cpu", dtype="float32", kv_cache_blocks=24, collective_timeout_s=60)


def prompts(vocab: int, lens=(3, 11, 6, 17), seed=5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def greedy(max_tokens: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep_v3")
    tiny_deepseek_v3(path, seed=11, router_gain=6.0, **TINY_V3_CONFIG)
    ps = prompts(TINY_V3_CONFIG["vocab_size"])
    reference = tokens(LLM(str(path), **COMMON).generate(ps, greedy()))
    return str(path), ps, reference


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep_v4")
    save_tiny_v4(path, seed=21, randomise_seed=4)
    ps = prompts(TINY_V4_KWARGS["vocab_size"])
    reference = tokens(LLM(str(path), **COMMON).generate(ps, greedy()))
    return str(path), ps, reference


def test_v3_ep2_with_replicas_and_periodic_eplb_matches_one_process(v3):
    path, ps, reference = v3
    # the plans read the engine's windowed counter (2-step windows) once a window has ended
    llm = LLM(path, expert_parallel_size=2, num_redundant_experts=2, eplb_interval=3, expert_load_window=2, **COMMON)
    try:
        assert tokens(llm.generate(ps, greedy())) == reference
        report = llm.engine.rank_report()
        assert [s["expert_slots"] for s in report] == [[5], [5]], "each rank holds its 10 / 2 slots only"
        done = [r for s in report for r in s["replacements"]]
        assert done, "eplb_interval=3 re-placed nothing in 10 steps"
        assert sum(r["received"] for r in done) > 0, "the load-based plans moved no expert"
    finally:
        llm.shutdown()


def test_v3_dp2_ep2_idle_rank_votes_and_forced_replacement_keep_tokens(v3):
    path, ps, reference = v3
    llm = LLM(path, data_parallel_size=2, expert_parallel_size=2, **COMMON)
    try:
        # one request: it goes to rank 0, rank 1 has none and must run empty steps meanwhile
        assert tokens(llm.generate(ps[3], greedy())) == [reference[3]]
        idle = llm.engine.rank_report()[1]
        assert idle["busy_steps"] == 0 and idle["empty_passes"] >= NEW, idle
        # all requests, spread over both ranks; mid-generation the experts move to a new table
        scrambled = torch.tensor([[7, 2, 5, 0, 6, 1, 4, 3]])  # every expert changes rank or slot
        seen, outs = 0, {}
        for out in llm.stream(ps, greedy()):
            seen += 1
            if seen == 6:
                llm.engine.rebalance(scrambled)
            if out.finished:
                outs[out.request_id] = out
        assert tokens(outs[k] for k in sorted(outs, key=int)) == reference
        stats = llm.engine.rank_report()
        assert all(s["replacements"] and s["replacements"][-1]["changed_layers"] == 1 for s in stats), stats
        moved_at = stats[0]["replacements"][-1]["after_step"]
        assert moved_at < stats[0]["steps"] - 1, "the re-placement came after the generation, not during it"
        assert all(s["busy_steps"] > 0 for s in stats), "the requests were not spread over both ranks"
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "model, dp, ep",
    [("v4", 1, 2), ("v4", 1, 4), ("v4", 2, 2), ("v3", 1, 4)],  # V3 at EP=2 and DP=2 x EP=2: the tests above
)
def test_expert_parallel_matches_one_process(request, model, dp, ep):
    path, ps, reference = request.getfixturevalue(model)
    llm = LLM(path, data_parallel_size=dp, expert_parallel_size=ep, **COMMON)
    try:
        assert tokens(llm.generate(ps, greedy())) == reference
    finally:
        llm.shutdown()


KILL_SCENARIO = textwrap.dedent(
    """
    import os, signal, sys, time
    from deepinfer_core import LLM, SamplingParams

    def main(path):
        llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=24, data_parallel_size=2,
                  expert_parallel_size=2, collective_timeout_s=20)
        pids = llm.engine.pids
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        outs, killed_at = {}, None
        for out in llm.stream([[5, 6, 7], [9, 10, 11, 12]], params):
            if killed_at is None:
                os.kill(pids[1], signal.SIGKILL)  # rank 1 dies mid-generation
                killed_at = time.monotonic()
            if out.finished:
                outs[out.request_id] = out
        waited = time.monotonic() - killed_at
        reasons = sorted((o.outputs[0].finish_reason, bool(o.outputs[0].error)) for o in outs.values())
        print("RESULT", reasons, round(waited, 1), flush=True)
        try:
            llm.generate([[1, 2]], params)
        except RuntimeError as exc:
            print("REFUSED", "down" in str(exc), flush=True)

    if __name__ == "__main__":
        main(sys.argv[1])
    """
)


def test_killed_rank_fails_every_request_and_the_driver_exits(v3, tmp_path):
    path = v3[0]
    script = tmp_path / "kill_rank.py"
    script.write_text(KILL_SCENARIO)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), path], capture_output=True, text=True, timeout=240, env=dict(os.environ)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert "[('error', True), ('error', True)]" in result, result
    assert float(result.split()[-1]) < 20, f"requests ended later than the collective timeout: {result}"
    assert "REFUSED True" in proc.stdout, proc.stdout
    assert time.monotonic() - start < 240


def test_bad_parallel_sizes_are_refused_before_any_process_starts(v3):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(v3[0], data_parallel_size=4, expert_parallel_size=2, **COMMON)
    with pytest.raises(ValueError, match="expert_parallel_size must be >= 1"):
        LLM(v3[0], expert_parallel_size=0, **COMMON)
