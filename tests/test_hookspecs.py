"""The contract is documented and exercised: every hook spec has a docstring that says who
calls it and what it returns, and some test in the repository calls every hook, either by name
or through the PluginHost facade method that calls it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from deepinfer_core.plugin_host import PluginHost
from deepinfer_core.testing.hooks import documentation_problems, hookspec_functions

REPO = Path(__file__).resolve().parents[1]

# Which PluginHost methods call each hook: engine code reaches hooks only through these.
FACADE = {
    "deepinfer_probe": ("plugins",),
    "deepinfer_platform": ("platform",),
    "deepinfer_attention_backend": ("attention_backend",),
    "deepinfer_moe_dispatcher": ("moe_dispatcher",),
    "deepinfer_decode_graphs": ("decode_graphs",),
    "deepinfer_batch_invariant_ops": ("batch_invariant_ops",),
    "deepinfer_fused_ops": ("fused_ops",),
    "deepinfer_weight_format": ("weight_format",),
    "deepinfer_fused_decode_step": ("fused_decode_step",),
    "deepinfer_register_kv_stores": ("kv_stores", "open_kv_store"),
    "deepinfer_register_protocols": ("protocols",),
    "deepinfer_register_prompt_encodings": ("prompt_encodings",),
    "deepinfer_register_output_parsers": ("output_parsers",),
    "deepinfer_register_spec_policies": ("drafters", "verification_policies"),
    "deepinfer_register_models": ("models", "model_sources"),
}


def test_hookspecs_found():
    assert len(hookspec_functions()) >= 10


def test_every_hookspec_is_documented():
    assert documentation_problems() == []


def test_documentation_check_catches_an_undocumented_hook(monkeypatch):
    from deepinfer_core import hookspecs

    @hookspecs.hookspec
    def deepinfer_undocumented(x):  # pragma: no cover - never called
        pass

    monkeypatch.setattr(hookspecs, "deepinfer_undocumented", deepinfer_undocumented, raising=False)
    assert any(p.startswith("deepinfer_undocumented: no docstring") for p in documentation_problems())


def test_facade_map_covers_exactly_the_hookspecs():
    assert set(FACADE) == set(hookspec_functions())
    for methods in FACADE.values():
        for method in methods:
            assert callable(getattr(PluginHost, method, None)), f"PluginHost.{method} is missing"


@pytest.mark.parametrize("hook", sorted(FACADE))
def test_facade_method_really_calls_its_hook(hook):
    """Guards the map above: the facade method's source names the hook it claims to call."""
    sources = [inspect.getsource(getattr(PluginHost, m)) for m in FACADE[hook]]
    assert any(hook in src for src in sources), f"no method in {FACADE[hook]} mentions {hook}"


def _test_sources() -> dict[Path, str]:
    files = list((REPO / "tests").rglob("test_*.py")) + list(REPO.glob("plugins/*/tests/**/test_*.py"))
    files += list((REPO / "deepinfer_core" / "testing").glob("*.py"))  # suites run by subclasses
    this = Path(__file__).resolve()
    return {f: f.read_text(encoding="utf-8") for f in files if f.resolve() != this}


@pytest.mark.parametrize("hook", sorted(FACADE))
def test_every_hook_is_exercised_by_some_test(hook):
    patterns = [re.escape(hook)] + [rf"\.{re.escape(m)}\(" for m in FACADE[hook]]
    callers = [
        str(path.relative_to(REPO))
        for path, text in _test_sources().items()
        if any(re.search(p, text) for p in patterns)
    ]
    assert callers, f"no test calls {hook} (or PluginHost.{'/'.join(FACADE[hook])})"
