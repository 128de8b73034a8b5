"""Conformance suite for model catalogues (``deepinfer_register_models``).

Subclass :class:`ModelRegistrySuite` and override the ``plugin`` fixture with the plugin object
(module or instance) whose ``deepinfer_register_models`` hook is under test.
"""

from __future__ import annotations

import inspect
import os

import pytest

from ..hookspecs import PROJECT

__all__ = ["ModelRegistrySuite"]


class ModelRegistrySuite:
    """What a model catalogue plugin must register."""

    @pytest.fixture
    def plugin(self):
        pytest.fail("a ModelRegistrySuite subclass must override the `plugin` fixture")

    @pytest.fixture
    def registered(self, plugin) -> tuple[list[tuple[str, object]], list[tuple[str, object]]]:
        hook = getattr(plugin, "deepinfer_register_models", None)
        if hook is None:
            pytest.skip("plugin does not implement deepinfer_register_models")
        models, sources = [], []
        callbacks = {
            "register": lambda n, f: models.append((n, f)),
            "register_source": lambda n, f: sources.append((n, f)),
        }
        params = inspect.signature(hook).parameters
        hook(**{name: callbacks[name] for name in params})
        return models, sources

    def test_hook_is_marked(self, plugin):
        hook = getattr(plugin, "deepinfer_register_models", None)
        if hook is None:
            pytest.skip("plugin does not implement deepinfer_register_models")
        assert hasattr(hook, f"{PROJECT}_impl"), "decorate the hook with deepinfer_core.hookspecs.hookimpl"

    def test_registers_something(self, registered):
        models, sources = registered
        assert models or sources

    def test_names_are_unique_strings(self, registered):
        for entries in registered:
            names = [name for name, _ in entries]
            assert all(isinstance(n, str) and n.strip() == n and n for n in names)
            assert len(names) == len(set(names)), f"duplicate names: {names}"

    def test_factories_are_callable(self, registered):
        models, _ = registered
        for name, factory in models:
            assert callable(factory), f"model factory for {name!r} is not callable"
            params = inspect.signature(factory).parameters
            assert len(params) >= 2, f"{name!r}: factory(config, ctx) takes two arguments"

    def test_sources_resolve_to_str_or_none(self, registered):
        _, sources = registered
        for name, resolve in sources:
            assert callable(resolve)
            path = resolve()
            assert path is None or isinstance(path, str), f"source {name!r} returned {path!r}"
            if path is not None:
                assert os.path.exists(path), f"source {name!r} points at a missing path {path}"
