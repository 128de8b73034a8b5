"""The placement bookkeeping of expert parallelism, against brute force (no processes): the
replica table a dispatcher routes by, the weight stream a rank loads its experts from, and where
each slot's weights come from in a re-placement."""

from __future__ import annotations

import random

import torch

from deepinfer_core.engine.parallel.experts import MoELayer, local_expert_weights
from deepinfer_core.engine.parallel.replacement import slot_sources
from deepinfer_core.moe import MoESpec, ParallelConfig
from deepinfer_core.moe.ep import ExpertParallelDispatcher, replica_table

E, RANKS, SPARE = 6, 2, 2  # 8 slots, 4 per rank


def random_placement(rng: random.Random, experts: int = E, slots: int = E + SPARE) -> torch.Tensor:
    table = list(range(experts)) + [rng.randrange(experts) for _ in range(slots - experts)]
    rng.shuffle(table)
    return torch.tensor(table)


def test_replica_table_lists_exactly_each_experts_slots():
    rng = random.Random(0)
    for _ in range(50):
        p2l = random_placement(rng)
        slots, counts = replica_table(p2l, E)
        for e in range(E):
            mine = {p for p in range(len(p2l)) if p2l[p] == e}
            assert counts[e] == len(mine) and set(slots[e].tolist()) == mine


def test_a_rank_loads_its_experts_under_its_slot_numbers():
    spec = MoESpec(layer_index=3, num_experts=E, top_k=2, hidden_size=4, intermediate_size=2)
    rng = random.Random(1)
    for rank in range(RANKS):
        dispatcher = ExpertParallelDispatcher(
            spec, ParallelConfig(ep_size=RANKS, rank=rank, num_redundant_experts=SPARE)
        )
        dispatcher.set_placement(random_placement(rng))
        layer = MoELayer(spec, dispatcher, module=None)
        mine = dispatcher.local_logical_experts()
        stream = [(f"model.layers.3.mlp.experts.{e}.gate_proj.weight", torch.full((2, 4), float(e))) for e in range(E)]
        stream += [(f"layers.3.ffn.experts.{e}.w2.weight", torch.full((4, 2), float(e))) for e in range(E)]
        stream += [("model.layers.3.mlp.experts.down_proj", torch.arange(E).float()[:, None, None].expand(E, 4, 2))]
        stream += [("model.layers.2.mlp.experts.0.up_proj.weight", torch.zeros(2, 4))]  # not an EP layer: as is
        stream += [("model.layers.3.self_attn.q_proj.weight", torch.zeros(4, 4))]
        got = dict(local_expert_weights(stream, [layer]))
        for slot, e in enumerate(mine):  # brute force: every local slot has its expert, nothing else is kept
            assert got[f"model.layers.3.mlp.experts.{slot}.gate_proj.weight"][0, 0] == e
            assert got[f"layers.3.ffn.experts.{slot}.w2.weight"][0, 0] == e
        assert not any(f"experts.{s}." in n for n in got for s in range(len(mine), E + SPARE) if "layers.3." in n)
        assert got["model.layers.3.mlp.experts.down_proj"][:, 0, 0].tolist() == [float(e) for e in mine]
        assert "model.layers.2.mlp.experts.0.up_proj.weight" in got and "model.layers.3.self_attn.q_proj.weight" in got


def test_each_new_slot_copies_its_expert_from_an_old_slot_on_its_own_rank_when_there_is_one():
    rng = random.Random(2)
    per_rank = (E + SPARE) // RANKS
    for _ in range(100):
        old, new = random_placement(rng), random_placement(rng)
        for p, q in enumerate(slot_sources(old, new, per_rank)):
            assert old[q] == new[p]
            local = [s for s in range(len(old)) if old[s] == new[p] and s // per_rank == p // per_rank]
            assert (q // per_rank == p // per_rank) == bool(local)
