"""The expert-parallel dispatcher over NCCL on one GPU (a group of one rank): the exchange's
all-to-all calls run through NCCL on CUDA tensors and the combined output equals the naive
per-token reference, with and without redundant replicas. Multi-GPU runs (2+ ranks) need a
machine with several GPUs; this is what one GPU can check. Skips without CUDA/NCCL."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()), reason="needs a CUDA GPU with NCCL"
)


@pytest.fixture(scope="module")
def nccl_group():
    import torch.distributed as dist

    from deepinfer_core.engine.parallel.launch import RankEnv, free_port, init_process_group

    assert init_process_group(RankEnv(0, 1, master_port=free_port()), "cuda", timeout_s=60) == "nccl"
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("redundant", [0, 2])
def test_nccl_dispatch_equals_the_naive_reference(nccl_group, redundant):
    from deepinfer_core.moe import ExpertWeights, ParallelConfig
    from deepinfer_core.moe.ep import ExpertParallelDispatcher
    from deepinfer_core.testing import ep as kit
    from deepinfer_core.testing.moe import naive_moe

    dev = torch.device("cuda", torch.cuda.current_device())
    spec = kit.SPEC
    cpu = kit._experts()
    full = ExpertWeights(cpu.gate_up.to(dev), cpu.down.to(dev))
    d = ExpertParallelDispatcher(spec, ParallelConfig(ep_size=1, rank=0, num_redundant_experts=redundant))
    if redundant:
        d.set_placement(torch.tensor(kit.REPLICA_PLACEMENT))
    mine = torch.tensor(d.local_logical_experts(), device=dev)
    local = ExpertWeights(full.gate_up[mine].contiguous(), full.down[mine].contiguous())
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, spec.hidden_size, generator=g).to(dev)
    logits = (torch.randn(37, spec.num_experts, generator=g) * 3).to(dev)
    ids, weights = d.select_experts(spec, logits)
    got = d.forward(spec, hidden, ids, weights, local)
    want = naive_moe(spec, hidden, ids, weights, full)
    assert got.device.type == "cuda"
    assert (got.double().cpu() - want.double().cpu()).abs().max().item() < 1e-4
    load = d.expert_load()
    assert torch.equal(load.cpu().long(), torch.bincount(ids.reshape(-1).cpu(), minlength=spec.num_experts))
