"""A plugin written for the previous contract (tests/fixtures/thirdparty_plugin_v1, contract 1:
no contract version, no capability declarations, ``select_experts`` without ``token_ids=``) keeps
working with this core: found, listed as contract 1, and its MoE dispatcher handed only layers it
can serve.

Runs only where ``deepinfer-acme-v1`` is pip-installed (``tox -e thirdparty_v1``)."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch

from deepinfer_core.moe import MoESpec
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher

try:
    DIST = metadata.distribution("deepinfer-acme-v1")
except metadata.PackageNotFoundError:
    DIST = None
pytestmark = pytest.mark.skipif(DIST is None, reason="pip install tests/fixtures/thirdparty_plugin_v1 to run these")

LEARNED = MoESpec(3, num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, scoring="sqrtsoftplus")
HASHED = MoESpec(0, num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, scoring="hash")


@pytest.fixture
def host(monkeypatch):
    from deepinfer_core.plugin_host import ALLOW_ENV, PluginHost

    monkeypatch.delenv(ALLOW_ENV, raising=False)
    return PluginHost()  # real entry points, nothing passed in-process


def test_declared_entry_point():
    (ep,) = [ep for ep in DIST.entry_points if ep.group == "deepinfer"]
    assert (ep.name, ep.value) == ("acme_v1", "deepinfer_acme_v1.plugin")


def test_listed_as_built_for_contract_1(host):
    info = {i.name: i for i in host.plugins()}["acme_v1"]
    assert (info.distribution, info.builtin, info.usable, info.error) == ("deepinfer-acme-v1", False, True, None)
    assert info.contract == 1  # it declares none
    assert set(info.hooks) == {
        "deepinfer_register_kv_stores",
        "deepinfer_register_spec_policies",
        "deepinfer_moe_dispatcher",
    }


def test_its_registries_still_replace_the_builtins(host):
    from deepinfer_acme_v1.store import AcmeMemoryStore

    assert host.kv_stores()["memory"] is AcmeMemoryStore
    assert host.registry_owner("deepinfer_register_spec_policies", "register_verification", "fixed") == "acme_v1"


def test_hash_layers_go_to_the_builtin_learned_layers_to_it(host):
    cpu = host.platform("cpu")
    assert host.moe_dispatcher(LEARNED, cpu).name == "acme-moe"
    assert type(host.moe_dispatcher(HASHED, cpu)) is TorchMoEDispatcher


def test_tiny_v4_greedy_tokens_are_transformers_with_it_installed(host, tmp_path):
    pytest.importorskip("transformers.models.deepseek_v4")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.testing.v4_tiny import save_tiny_v4

    hf = save_tiny_v4(tmp_path, seed=1234, randomise_seed=5)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=32, host=host)
    prompt = torch.randint(2, hf.config.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 11, dtype=torch.long), max_new_tokens=6)
    assert out[0].outputs[0].token_ids == want[0, 11:].tolist()
    assert "hash_moe" in hf.config.mlp_layer_types and "moe" in hf.config.mlp_layer_types
