"""Contracts that evolve: capability declarations route each layer to a backend that can serve it,
and contract versions say what a plugin was built for (docs/writing-plugins.md, "Compatibility")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from deepinfer_core import hookspecs
from deepinfer_core.attention import AttentionCapabilities, AttentionKind, AttentionLayerSpec
from deepinfer_core.attention.torch_ref import TorchAttentionBackend
from deepinfer_core.attention.v4_ref import TorchV4AttentionBackend
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.moe import PREVIOUS_CONTRACT_MOE, MoECapabilities, MoESpec, moe_capabilities
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher
from deepinfer_core.plugin_host import NoImplementationError, PluginContractError, PluginHost

LEARNED = MoESpec(0, num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, scoring="sqrtsoftplus")
HASHED = MoESpec(1, num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, scoring="hash")
FULL = AttentionLayerSpec(AttentionKind.FULL, 0, num_heads=2, num_kv_heads=2, head_dim=8, v_head_dim=8, scale=0.3)
MLA = AttentionLayerSpec(AttentionKind.MLA, 1, 2, 1, 8, 4, 0.3, kv_shared=True)
V4_SLIDING = AttentionLayerSpec(AttentionKind.SLIDING, 2, 2, 1, 8, 8, 0.3, kv_shared=True, window=4, state_kv=True)


class PreviousContractDispatcher:
    """A dispatcher as written against contract 1: ``select_experts(spec, logits, bias)`` with no
    keyword arguments and no capability declaration (the reference's math underneath)."""

    name = "previous-contract"

    def __init__(self, used: list[int] | None = None) -> None:
        self._ref = TorchMoEDispatcher()
        self._used = used

    def select_experts(self, spec, router_logits, correction_bias=None):
        if self._used is not None:
            self._used.append(spec.layer_index)
        return self._ref.select_experts(spec, router_logits, correction_bias)

    def forward(self, spec, hidden, topk_ids, topk_weights, experts):
        return self._ref.forward(spec, hidden, topk_ids, topk_weights, experts)

    def expert_load(self):
        return self._ref.expert_load()


def plugin(**hooks) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def moe_plugin(make):
    return plugin(deepinfer_moe_dispatcher=lambda moe, platform, parallel: make())


def host_with(**plugins) -> PluginHost:
    return PluginHost(load_entry_points=False, extra_plugins=plugins)


# -- MoE -----------------------------------------------------------------------------------------
def test_undeclared_dispatcher_is_the_previous_contract():
    assert moe_capabilities(PreviousContractDispatcher()) == PREVIOUS_CONTRACT_MOE
    assert not PREVIOUS_CONTRACT_MOE.hash_routing
    assert PREVIOUS_CONTRACT_MOE.unsupported(LEARNED) is None
    assert "hash routing" in PREVIOUS_CONTRACT_MOE.unsupported(HASHED)
    assert moe_capabilities(TorchMoEDispatcher()).unsupported(HASHED) is None


def test_hash_layers_go_past_a_dispatcher_without_hash_routing():
    host = host_with(old=moe_plugin(PreviousContractDispatcher))
    cpu = host.platform("cpu")
    assert host.moe_dispatcher(LEARNED, cpu).name == "previous-contract"
    assert type(host.moe_dispatcher(HASHED, cpu)) is TorchMoEDispatcher  # the builtin serves it


def test_a_dispatcher_declaring_hash_routing_gets_hash_layers():
    class Declared(PreviousContractDispatcher):
        name = "declared"
        capabilities = MoECapabilities(hash_routing=True)

        def select_experts(self, spec, router_logits, correction_bias=None, *, token_ids=None, hash_table=None):
            return self._ref.select_experts(
                spec, router_logits, correction_bias, token_ids=token_ids, hash_table=hash_table
            )

    host = host_with(new=moe_plugin(Declared), old=moe_plugin(PreviousContractDispatcher))
    assert host.moe_dispatcher(HASHED, host.platform("cpu")).name == "declared"


def test_declared_scorings_limit_what_a_dispatcher_is_handed():
    class SoftmaxOnly(PreviousContractDispatcher):
        name = "softmax-only"
        capabilities = MoECapabilities(scorings=frozenset({"softmax"}))

    host = host_with(soft=moe_plugin(SoftmaxOnly))
    cpu = host.platform("cpu")
    assert host.moe_dispatcher(MoESpec(0, 8, 2, 8, 8, scoring="softmax"), cpu).name == "softmax-only"
    assert type(host.moe_dispatcher(LEARNED, cpu)) is TorchMoEDispatcher


def test_a_named_dispatcher_that_cannot_serve_a_layer_says_why():
    host = host_with(old=moe_plugin(PreviousContractDispatcher))
    with pytest.raises(NoImplementationError, match=r"moe backend 'old' cannot serve MoE layer 1 .*hash routing"):
        host.moe_dispatcher(HASHED, host.platform("cpu"), name="old")


def test_a_malformed_declaration_is_named():
    class Wrong(PreviousContractDispatcher):
        capabilities = {"hash_routing": True}

    host = host_with(wrong=moe_plugin(Wrong))
    with pytest.raises(PluginContractError, match=r"plugin 'wrong'.*must be a MoECapabilities"):
        host.moe_dispatcher(LEARNED, host.platform("cpu"))


def test_previous_contract_dispatcher_runs_the_suite_with_hash_cases_skipped(tmp_path):
    """The conformance suite skips, with the reason, what the dispatcher does not claim: the
    hash cases end as skips, never as ``TypeError: unexpected keyword argument 'token_ids'``."""
    (tmp_path / "test_old.py").write_text(
        textwrap.dedent(
            """
            import pytest
            from deepinfer_core.plugin_host import PluginHost
            from deepinfer_core.testing.moe import MoEDispatcherSuite
            from test_contracts import PreviousContractDispatcher

            class TestOld(MoEDispatcherSuite):
                @pytest.fixture
                def platform(self):
                    return PluginHost(load_entry_points=False).platform("cpu")

                @pytest.fixture
                def dispatcher(self, spec, platform):
                    return PreviousContractDispatcher()
            """
        )
    )
    env_path = os.pathsep.join([str(tmp_path), str(Path(__file__).parent), *sys.path])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path / "test_old.py")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "failed" not in result.stdout and "TypeError" not in result.stdout
    assert "previous-contract does not claim hash routing (MoECapabilities.hash_routing)" in result.stdout
    assert "passed" in result.stdout


# -- attention -----------------------------------------------------------------------------------
def test_attention_layers_go_to_a_backend_that_declares_their_kind():
    class FullOnly(TorchAttentionBackend):
        name = "full-only"
        capabilities = AttentionCapabilities(kinds=frozenset({AttentionKind.FULL}))

    host = host_with(fo=plugin(deepinfer_attention_backend=lambda layer, platform: FullOnly()))
    cpu = host.platform("cpu")
    assert host.attention_backend(FULL, cpu).name == "full-only"
    assert type(host.attention_backend(MLA, cpu)) is TorchAttentionBackend
    assert type(host.attention_backend(V4_SLIDING, cpu)) is TorchV4AttentionBackend
    with pytest.raises(NoImplementationError, match=r"cannot serve attention layer 1 \('mla' layers\)"):
        host.attention_backend(MLA, cpu, name="fo")


def test_an_undeclared_backend_never_gets_a_state_kv_layer_it_cannot_run():
    class Old:  # contract 1: kv_cache_shape / forward, no declaration, no forward_v4
        name = "old-attention"

        def kv_cache_shape(self, spec, num_blocks, block_size):
            return (num_blocks, block_size)

        def forward(self, spec, q, k, v, kv_cache, meta):
            return q

    host = host_with(old=plugin(deepinfer_attention_backend=lambda layer, platform: Old()))
    cpu = host.platform("cpu")
    assert host.attention_backend(FULL, cpu).name == "old-attention"  # served as before
    assert type(host.attention_backend(V4_SLIDING, cpu)) is TorchV4AttentionBackend


def test_the_references_declare_what_they_serve():
    ref, v4 = TorchAttentionBackend.capabilities, TorchV4AttentionBackend.capabilities
    assert ref.serves(FULL) and ref.serves(MLA) and not ref.serves(V4_SLIDING)
    assert v4.serves(V4_SLIDING) and not v4.serves(FULL)


# -- contract versions ---------------------------------------------------------------------------
def info(plugin_object):
    host = host_with(p=plugin_object)
    return {i.name: i for i in host.plugins()}["p"]


def probe_plugin(**attrs):
    module = plugin(deepinfer_probe=lambda: True)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def test_an_undeclared_plugin_was_built_for_contract_1():
    got = info(probe_plugin())
    assert got.contract == 1 and got.usable and got.note == ""


def test_a_declared_current_contract_loads():
    got = info(probe_plugin(DEEPINFER_CONTRACT=hookspecs.CONTRACT_VERSION))
    assert got.contract == hookspecs.CONTRACT_VERSION and got.usable and got.hooks == ["deepinfer_probe"]


def test_builtins_speak_the_current_contract():
    assert {i.contract for i in PluginHost(load_entry_points=False).plugins()} == {hookspecs.CONTRACT_VERSION}


@pytest.mark.parametrize(
    ("declared", "says"),
    [
        (hookspecs.CONTRACT_VERSION + 1, "upgrade deepinfer-core"),
        (hookspecs.OLDEST_CONTRACT_VERSION - 1, "upgrade the plugin"),
        ("2", "must be an int"),
    ],
)
def test_a_contract_this_core_does_not_serve_is_listed_with_the_reason(declared, says):
    got = info(probe_plugin(DEEPINFER_CONTRACT=declared))
    assert not got.usable and says in got.reason and got.hooks == []


def test_a_deprecated_contract_loads_with_a_note(monkeypatch):
    monkeypatch.setitem(hookspecs.DEPRECATED_CONTRACTS, 1, "not loaded from deepinfer-core 0.9")
    got = info(probe_plugin())
    assert got.usable and got.note == "contract 1 is deprecated: not loaded from deepinfer-core 0.9"


# -- end to end ----------------------------------------------------------------------------------
def test_tiny_v4_runs_with_a_previous_contract_dispatcher_installed(tmp_path):
    """DeepSeek-V4's hash layers go to the builtin, its learned layers to the old dispatcher, and
    the greedy tokens are transformers' own."""
    pytest.importorskip("transformers.models.deepseek_v4")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.testing.v4_tiny import save_tiny_v4

    hf = save_tiny_v4(tmp_path, seed=1234, randomise_seed=5)
    used: list[int] = []
    host = host_with(old=moe_plugin(lambda: PreviousContractDispatcher(used)))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=32, host=host)
    prompt = torch.randint(2, hf.config.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 11, dtype=torch.long), max_new_tokens=6)
    assert out[0].outputs[0].token_ids == want[0, 11:].tolist()
    kinds = hf.config.mlp_layer_types
    assert "hash_moe" in kinds
    assert set(used) == {i for i, kind in enumerate(kinds) if kind == "moe"}, f"old dispatcher got layers {set(used)}"
