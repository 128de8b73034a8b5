"""Choosing one plugin's attention / MoE implementation (``LLM(attention_backend=...,
moe_backend=...)``, ``deepinfer generate --attention-backend``), and the default order."""

from __future__ import annotations

import pytest

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
from deepinfer_core.attention.torch_ref import TorchAttentionBackend
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.moe import MoESpec
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher
from deepinfer_core.plugin_host import NoImplementationError, PluginHost, UnknownBackendError

SPEC = AttentionLayerSpec(AttentionKind.FULL, 0, num_heads=2, num_kv_heads=2, head_dim=8, v_head_dim=8, scale=0.3)
MOE = MoESpec(0, num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)


class Tagged(TorchAttentionBackend):
    """The reference backend under another name, so a test can see whose backend was built."""

    def __init__(self, owner: str, built: list[str] | None = None) -> None:
        self.name = owner
        if built is not None:
            built.append(owner)


class TaggedMoE(TorchMoEDispatcher):
    def __init__(self, owner: str) -> None:
        super().__init__()
        self.name = owner


def provider(owner: str, built: list[str] | None = None, kinds=(AttentionKind.FULL, AttentionKind.MLA)):
    class Plugin:
        @hookimpl
        def deepinfer_attention_backend(self, layer, platform):
            return Tagged(owner, built) if layer.kind in kinds else None

        @hookimpl
        def deepinfer_moe_dispatcher(self, moe):  # a subset of the spec's arguments is fine
            return TaggedMoE(owner)

    return Plugin()


@pytest.fixture
def host():
    # registered in the order zeta, alpha: the default must not depend on registration order
    return PluginHost(load_entry_points=False, extra_plugins={"zeta": provider("zeta"), "alpha": provider("alpha")})


def test_default_order_is_installed_plugins_by_name_then_builtin(host):
    cpu = host.platform("cpu")
    assert host.backend_providers("deepinfer_attention_backend") == ["alpha", "zeta", "core.kernels"]
    assert host.attention_backend(SPEC, cpu).name == "alpha"
    assert host.moe_dispatcher(MOE, cpu).name == "alpha"


def test_a_named_plugin_answers_alone(host):
    cpu = host.platform("cpu")
    assert host.attention_backend(SPEC, cpu, name="zeta").name == "zeta"
    assert host.moe_dispatcher(MOE, cpu, name="zeta").name == "zeta"
    ref = host.attention_backend(SPEC, cpu, name="builtin")
    assert type(ref) is TorchAttentionBackend
    assert type(host.moe_dispatcher(MOE, cpu, name="builtin")) is TorchMoEDispatcher


def test_unknown_name_lists_the_available_ones(host):
    with pytest.raises(UnknownBackendError, match=r"unknown attention backend 'nope'; available: alpha, zeta, builtin"):
        host.attention_backend(SPEC, host.platform("cpu"), name="nope")
    with pytest.raises(ValueError, match=r"unknown moe backend 'cuda'; available: alpha, zeta, builtin"):
        host.moe_dispatcher(MOE, host.platform("cpu"), name="cuda")


def test_a_named_plugin_without_that_kind_is_an_error_not_a_fallback():
    host = PluginHost(
        load_entry_points=False, extra_plugins={"fullonly": provider("fullonly", kinds=(AttentionKind.FULL,))}
    )
    sliding = AttentionLayerSpec(AttentionKind.SLIDING, 0, 2, 2, 8, 8, 0.3, window=4)
    cpu = host.platform("cpu")
    with pytest.raises(NoImplementationError, match=r"from 'fullonly' for 'sliding' layers"):
        host.attention_backend(sliding, cpu, name="fullonly")
    assert type(host.attention_backend(sliding, cpu)) is TorchAttentionBackend  # unnamed: falls through


# -- through the engine ---------------------------------------------------------------------
pytest.importorskip("transformers")  # the tiny_llama fixture (tests/conftest.py) builds with it


def test_llm_uses_the_named_backend_for_every_layer(tiny_llama):
    from deepinfer_core import LLM, SamplingParams

    built: list[str] = []
    host = PluginHost(
        load_entry_points=False, extra_plugins={"zeta": provider("zeta", built), "alpha": provider("alpha", built)}
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chosen = LLM(tiny_llama, device="cpu", kv_cache_blocks=4, attention_backend="zeta", host=host)
    assert built and set(built) == {"zeta"}
    reference = LLM(tiny_llama, device="cpu", kv_cache_blocks=4, attention_backend="builtin", host=host)
    assert (
        chosen.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
        == reference.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    )


def test_llm_rejects_an_unknown_backend_before_reading_the_model(tmp_path):
    from deepinfer_core import LLM

    host = PluginHost(load_entry_points=False)
    with pytest.raises(ValueError, match=r"unknown moe backend 'triton'; available: builtin"):
        LLM(str(tmp_path / "no-such-model"), device="cpu", moe_backend="triton", host=host)


def test_cli_flags_reach_the_engine(capsys):
    from deepinfer_core.entrypoints.main import main

    assert main(["generate", "--device", "cpu", "--attention-backend", "nope", "hello"]) == 2
    err = capsys.readouterr().err
    assert "unknown attention backend 'nope'; available:" in err and "builtin" in err
