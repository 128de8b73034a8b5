"""fused_ops.install hands a platform's kernels to the modules that use them, without knowing any
model class: each module takes what it runs (``use_fused_ops``). Checked on the CPU with marker
callables on every architecture's modules (the GPU plugin's tests run the real kernels)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from deepinfer_core.attention.torch_ref import TorchAttentionBackend
from deepinfer_core.attention.v4_ref import TorchV4AttentionBackend
from deepinfer_core.fused_ops import FusedOps, install
from deepinfer_core.models import ModelContext
from deepinfer_core.models.deepseek_v3 import model as deepseek_v3
from deepinfer_core.models.deepseek_v3.mla import MLAAttention
from deepinfer_core.models.deepseek_v4 import model as deepseek_v4
from deepinfer_core.models.deepseek_v4.layers import HyperConnection, V4RMSNorm
from deepinfer_core.models.deepseek_v4.model import V4Attention
from deepinfer_core.models.layers import GatedMLP, RMSNorm, Rotary
from deepinfer_core.models.llama import model as llama
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher

transformers = pytest.importorskip("transformers")


def kernel(name: str):
    def marker(*args, **kwargs):
        raise AssertionError(f"{name} is not run here")

    marker.__name__ = name
    return marker


ALL = FusedOps(**{f.name: kernel(f.name) for f in fields(FusedOps)})


def context() -> ModelContext:
    return ModelContext(
        torch.device("cpu"),
        torch.bfloat16,
        lambda spec: TorchV4AttentionBackend() if spec.state_kv else TorchAttentionBackend(),
        lambda spec: TorchMoEDispatcher(),
    )


def build(arch: str) -> torch.nn.Module:
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )  # fmt: skip
        return llama.build(cfg.to_dict(), context())
    if arch == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, n_shared_experts=1,
        )  # fmt: skip
        return deepseek_v3.build(cfg.to_dict(), context())
    from deepinfer_core.testing.v4_tiny import tiny_v4_config

    return deepseek_v4.build(tiny_v4_config().to_dict(), context())


TAKES = {  # module class -> {attribute: the FusedOps field it must hold after install}
    RMSNorm: {"fused": "rms_norm", "fused_add": "add_rms_norm"},
    GatedMLP: {"fused_act": "silu_and_mul", "linear": "dense_linear"},
    Rotary: {"fused": "rotary"},
    MLAAttention: {"rope_cat": "rope_cat", "norm_rope_cat": "norm_rope_cat", "linear": "dense_linear"},
    V4RMSNorm: {"fused": "v4_rms_norm"},
    HyperConnection: {"fused_mix": "hc_mix", "fused_merge": "hc_merge", "fused_norm": "v4_unweighted_rms_norm"},
    V4Attention: {"rope_kernel": "v4_rope", "norm_kernel": "v4_unweighted_rms_norm"},
}


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "deepseek_v4"])
def test_every_module_takes_its_kernels(arch):
    model = build(arch)
    taking = [m for m in model.modules() if type(m) in TAKES]
    assert taking, "the model has none of the modules under test"
    n = install(model, ALL)
    head = int("logits_kernel" in type(model).__dict__)
    assert n == len(taking) + head
    for module in taking:
        for attribute, field in TAKES[type(module)].items():
            assert getattr(module, attribute) is getattr(ALL, field), (type(module).__name__, attribute)
    if head:
        assert model.logits_kernel is ALL.logits


def test_a_module_without_its_kernel_keeps_its_torch_ops():
    """Only what the platform offers is installed: offering the norm alone leaves the MLPs,
    rotary tables and MLA layers on torch ops, and counts only the norms."""
    model = build("deepseek_v3")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert install(model, FusedOps(rms_norm=ALL.rms_norm)) == len(norms)
    assert all(m.fused is ALL.rms_norm and m.fused_add is None for m in norms)
    assert all(m.fused_act is None and m.linear is None for m in model.modules() if isinstance(m, GatedMLP))
    assert all(m.rope_cat is None for m in model.modules() if isinstance(m, MLAAttention))
    assert install(build("llama"), None) == 0
