"""Conformance suite for expert-parallel MoE dispatchers (``deepinfer_moe_dispatcher`` with
``ParallelConfig.ep_size > 1``), run across real ranks: 2 gloo processes on the CPU.

Subclass :class:`ExpertParallelSuite` and override the class-scoped ``dispatcher_factory``
fixture (a classmethod): it returns a module-level function ``factory(spec, parallel) ->
dispatcher`` (pickled into the rank processes, so not a lambda), e.g. your plugin's hook with your
platform bound. Every rank builds its dispatcher with ``ParallelConfig(ep_size=2, rank=r,
num_redundant_experts=...)``, gets the weights of its own slots only
(``experts[dispatcher.local_logical_experts()]``) and its own tokens, and the combined output of
each rank's tokens must equal :func:`naive_moe` on the full expert set (a per-token loop in
float64: the single-rank reference). The cases:

- ``uneven``: the ranks hold different numbers of tokens;
- ``one_rank_empty``: rank 1 has no tokens at all (the empty step of attention data parallelism)
  and must still serve its experts to rank 0;
- ``replicas``: 2 redundant slots and a placement that replicates two experts and scrambles the
  rest (``set_placement``): tokens of a replicated expert spread over its replicas, same result;
- ``load``: ``expert_load()`` counts every rank's own routed tokens per logical expert.

All cases run in one pair of rank processes per test class (``ep_results``).
"""

from __future__ import annotations

import traceback

import pytest
import torch

from ..engine.parallel.launch import RankEnv, free_port, init_process_group, rank_context, start_ranks
from ..moe import ExpertWeights, MoESpec, ParallelConfig
from .moe import naive_moe

__all__ = ["ExpertParallelSuite", "builtin_ep_dispatcher", "run_ep_cases"]

WORLD = 2
SPEC = MoESpec(layer_index=3, num_experts=8, top_k=3, hidden_size=16, intermediate_size=12, scoring="sigmoid")
TOKENS = {"uneven": (11, 4), "one_rank_empty": (9, 0), "replicas": (7, 10), "load": (6, 5)}
# 10 slots over 2 ranks: experts 2 and 5 twice, the rest scrambled across the ranks
REPLICA_PLACEMENT = [5, 0, 2, 7, 3, 2, 6, 1, 4, 5]


def builtin_ep_dispatcher(spec: MoESpec, parallel: ParallelConfig):
    """The core's expert-parallel dispatcher, through its builtin hook."""
    from ..builtin.kernels import deepinfer_moe_dispatcher

    return deepinfer_moe_dispatcher(spec, None, parallel)


def _inputs(case: str, rank: int):
    g = torch.Generator().manual_seed(100 + rank + 10 * list(TOKENS).index(case))
    t = TOKENS[case][rank]
    hidden = torch.randn(t, SPEC.hidden_size, generator=g)
    logits = torch.randn(t, SPEC.num_experts, generator=g) * 3
    return hidden, logits


def _experts() -> ExpertWeights:
    g = torch.Generator().manual_seed(7)
    e, i, d = SPEC.num_experts, SPEC.intermediate_size, SPEC.hidden_size
    return ExpertWeights(torch.randn(e, 2 * i, d, generator=g) / d**0.5, torch.randn(e, d, i, generator=g) / i**0.5)


def _local(full: ExpertWeights, dispatcher) -> ExpertWeights:
    mine = torch.tensor(dispatcher.local_logical_experts())
    return ExpertWeights(full.gate_up[mine].clone(), full.down[mine].clone())


def _rank_main(rank: int, factory, port: int, results) -> None:
    try:
        init_process_group(RankEnv(rank, WORLD, master_port=port), "cpu", timeout_s=60)
        torch.set_num_threads(1)
        full = _experts()
        out = {}
        for case in TOKENS:
            redundant = 2 if case == "replicas" else 0
            dispatcher = factory(SPEC, ParallelConfig(ep_size=WORLD, rank=rank, num_redundant_experts=redundant))
            if case == "replicas":
                dispatcher.set_placement(torch.tensor(REPLICA_PLACEMENT))
            hidden, logits = _inputs(case, rank)
            ids, weights = dispatcher.select_experts(SPEC, logits)
            got = dispatcher.forward(SPEC, hidden, ids, weights, _local(full, dispatcher))
            want = naive_moe(SPEC, hidden, ids, weights, full)
            err = (got.double() - want).abs().max().item() if hidden.shape[0] else 0.0
            load = dispatcher.expert_load()
            want_load = torch.bincount(ids.reshape(-1), minlength=SPEC.num_experts)
            out[case] = {
                "max_error": err,
                "shape_ok": tuple(got.shape) == tuple(hidden.shape),
                "load_ok": load is not None and torch.equal(load.cpu().long(), want_load),
            }
        results.put((rank, out))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ep_cases(factory, timeout_s: float = 120.0) -> dict[int, dict]:
    """Run every case on 2 gloo ranks; ``{rank: {case: {"max_error", "shape_ok", "load_ok"}}}``
    (or ``{rank: {"error": traceback}}``)."""
    import queue

    results = rank_context().Queue()
    ctx = start_ranks(_rank_main, WORLD, (factory, free_port(), results))
    got: dict[int, dict] = {}
    try:
        while len(got) < WORLD:
            try:
                rank, out = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"expert-parallel ranks gave no result in {timeout_s} s") from None
            got[rank] = out
        ctx.join(timeout=timeout_s)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return got


class ExpertParallelSuite:
    """What every expert-parallel :class:`~deepinfer_core.moe.MoEDispatcher` must do."""

    atol: float = 1e-4

    @pytest.fixture(scope="class")
    @classmethod
    def dispatcher_factory(cls):
        pytest.fail("an ExpertParallelSuite subclass must override the `dispatcher_factory` fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def ep_results(cls, dispatcher_factory) -> dict[int, dict]:
        results = run_ep_cases(dispatcher_factory)
        for rank, out in results.items():
            if "error" in out:
                pytest.fail(f"rank {rank} failed:\n{out['error']}")
        return results

    @pytest.mark.parametrize("case", ["uneven", "one_rank_empty", "replicas"])
    def test_combined_output_equals_the_single_rank_reference(self, ep_results, case):
        for rank, out in ep_results.items():
            assert out[case]["shape_ok"], f"rank {rank}: output shape differs from its input's"
            assert out[case]["max_error"] <= self.atol, f"rank {rank}, case {case}: {out[case]['max_error']}"

    def test_expert_load_counts_each_ranks_routed_tokens(self, ep_results):
        for rank, out in ep_results.items():
            assert out["load"]["load_ok"], f"rank {rank}: expert_load() is not the per-expert count of its tokens"
