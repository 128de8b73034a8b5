"""Plugin discovery and precedence, with fake entry points and in-process plugins."""

from __future__ import annotations

import pytest

from deepinfer_core import plugin_host
from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
from deepinfer_core.attention.torch_ref import TorchAttentionBackend
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.moe import MoESpec
from deepinfer_core.platform import ProbeResult, TorchPlatform
from deepinfer_core.plugin_host import NoImplementationError, PluginConflictError, PluginHost

SPEC = AttentionLayerSpec(AttentionKind.FULL, 0, num_heads=2, num_kv_heads=2, head_dim=8, v_head_dim=8, scale=0.3)


class FakeDist:
    def __init__(self, name: str, version: str = "1.2.3") -> None:
        self.name, self.version = name, version


class FakeEntryPoint:
    """Stands in for an importlib.metadata entry point of an installed distribution."""

    def __init__(self, name: str, plugin=None, error: Exception | None = None) -> None:
        self.name, self.dist, self._plugin, self._error = name, FakeDist(f"dist-{name}"), plugin, error
        self.loads = 0

    def load(self):
        self.loads += 1
        if self._error is not None:
            raise self._error
        return self._plugin


class InstalledEntryPoints(list):
    """The fake installed entry points, plus the groups they were looked up for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []


@pytest.fixture
def installed(monkeypatch):
    """Replace the installed entry points with a list the test fills in; counts lookups."""
    eps = InstalledEntryPoints()
    calls = eps.calls

    def entry_points(group):
        calls.append(group)
        return list(eps)

    monkeypatch.setattr(plugin_host.metadata, "entry_points", entry_points)
    monkeypatch.delenv(plugin_host.ALLOW_ENV, raising=False)
    return eps


class DevicePlugin:
    def __init__(self, device_type: str, usable: bool = True) -> None:
        self.device_type, self.usable = device_type, usable

    @hookimpl
    def deepinfer_platform(self, request):
        if request.device_type in ("auto", self.device_type):
            platform = TorchPlatform(f"fake-{self.device_type}", self.device_type)
            platform.probe = lambda: ProbeResult(self.usable, "" if self.usable else "fake device absent")
            return platform
        return None


class StorePlugin:
    def __init__(self, *names: str) -> None:
        self.names = names

    @hookimpl
    def deepinfer_register_kv_stores(self, register):
        for name in self.names:
            register(name, lambda config: None)


# -- loading ------------------------------------------------------------------------------
def test_loading_is_lazy_and_idempotent(installed):
    ep = FakeEntryPoint("lazy", StorePlugin("lazy-store"))
    installed.append(ep)
    host = PluginHost()
    assert installed.calls == [] and ep.loads == 0, "constructing a host must not discover plugins"
    assert "lazy-store" in host.kv_stores()
    host.kv_stores(), host.plugins(), host.pm
    assert installed.calls == ["deepinfer"] and ep.loads == 1


def test_builtins_are_registered_and_listed(installed):
    infos = {i.name: i for i in PluginHost().plugins()}
    assert {"core.platforms", "core.kernels", "core.catalogues"} <= set(infos)
    assert all(infos[n].builtin and infos[n].usable for n in ("core.platforms", "core.kernels"))
    assert "deepinfer_platform" in infos["core.platforms"].hooks


def test_allow_list_limits_loaded_plugins(installed, monkeypatch):
    wanted, other = FakeEntryPoint("wanted", StorePlugin("a")), FakeEntryPoint("other", StorePlugin("b"))
    installed.extend([wanted, other])
    monkeypatch.setenv(plugin_host.ALLOW_ENV, "wanted, something-else")
    host = PluginHost()
    stores = host.kv_stores()
    assert "a" in stores and "b" not in stores
    assert other.loads == 0, "a plugin outside DEEPINFER_PLUGINS must not even be imported"
    assert "other" not in {i.name for i in host.plugins()}
    assert "memory" in stores, "builtins are always loaded"


def test_plugin_that_fails_to_import_is_reported_not_fatal(installed):
    installed.append(FakeEntryPoint("broken", error=ImportError("libhccl.so: cannot open shared object file")))
    installed.append(FakeEntryPoint("fine", StorePlugin("fine-store")))
    host = PluginHost()
    assert "fine-store" in host.kv_stores()
    infos = {i.name: i for i in host.plugins()}
    assert not infos["broken"].usable
    assert "import failed" in infos["broken"].reason and "libhccl.so" in infos["broken"].reason
    assert infos["broken"].distribution == "dist-broken" and infos["broken"].version == "1.2.3"
    assert infos["fine"].usable


def test_probe_that_raises_is_reported(installed):
    class Raises:
        @hookimpl
        def deepinfer_probe(self):
            raise RuntimeError("driver exploded")

    infos = {i.name: i for i in PluginHost(extra_plugins={"raises": Raises()}).plugins()}
    assert not infos["raises"].usable and "driver exploded" in infos["raises"].reason


def test_misspelled_hook_rejects_plugin_with_clear_error(installed):
    class Misspelled:
        @hookimpl
        def deepinfer_platfrom(self, request):
            return TorchPlatform("typo", "cpu")

    host = PluginHost(extra_plugins={"typo": Misspelled()})
    info = {i.name: i for i in host.plugins()}["typo"]
    assert not info.usable
    assert "deepinfer_platfrom" in info.reason and "misspelled" in info.reason
    assert host.platform("cpu").name == "cpu", "a rejected plugin takes no part"


def test_hook_with_unknown_argument_rejects_plugin(installed):
    class BadArgs:
        @hookimpl
        def deepinfer_attention_backend(self, layer, device):
            return object()

    host = PluginHost(extra_plugins={"badargs": BadArgs()})
    info = {i.name: i for i in host.plugins()}["badargs"]
    assert not info.usable and "device" in info.reason
    assert isinstance(host.attention_backend(SPEC, host.platform("cpu")), TorchAttentionBackend)


# -- precedence ---------------------------------------------------------------------------
def test_installed_plugin_overrides_builtin_attention_and_moe(installed):
    sentinel_attention, sentinel_moe = object(), object()

    class Fast:
        @hookimpl
        def deepinfer_attention_backend(self, layer, platform):
            return sentinel_attention

        @hookimpl
        def deepinfer_moe_dispatcher(self, moe, platform, parallel):
            return sentinel_moe

    host = PluginHost(extra_plugins={"fast": Fast()})
    cpu = host.platform("cpu")
    assert host.attention_backend(SPEC, cpu) is sentinel_attention
    moe = MoESpec(0, num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    assert host.moe_dispatcher(moe, cpu) is sentinel_moe


def test_builtin_answers_when_plugin_declines(installed):
    class Declines:
        @hookimpl
        def deepinfer_attention_backend(self, layer, platform):
            return None

    host = PluginHost(extra_plugins={"declines": Declines()})
    assert isinstance(host.attention_backend(SPEC, host.platform("cpu")), TorchAttentionBackend)


def test_no_backend_for_unsupported_kind_raises(installed):
    host = PluginHost()
    spec = AttentionLayerSpec(AttentionKind.HEAVILY_COMPRESSED, 0, 2, 2, 8, 8, 0.3, compress_ratio=128)
    with pytest.raises(NoImplementationError, match="heavily_compressed"):
        host.attention_backend(spec, host.platform("cpu"))


def test_plugin_registry_entry_replaces_builtin(installed):
    class Store:
        pass

    class Override:
        @hookimpl
        def deepinfer_register_kv_stores(self, register):
            register("memory", Store)

    host = PluginHost(extra_plugins={"override": Override()})
    assert host.kv_stores()["memory"] is Store
    assert host.registry_owner("deepinfer_register_kv_stores", "register", "memory") == "override"
    assert host.registry_owner("deepinfer_register_kv_stores", "register", "local") == "core.catalogues"


def test_two_plugins_registering_one_name_conflict(installed):
    host = PluginHost(extra_plugins={"alpha": StorePlugin("shared"), "beta": StorePlugin("shared")})
    with pytest.raises(PluginConflictError, match="alpha") as err:
        host.kv_stores()
    assert "beta" in str(err.value) and "shared" in str(err.value)


def test_registry_rejects_bad_names_and_factories(installed):
    class BadName:
        @hookimpl
        def deepinfer_register_kv_stores(self, register):
            register("", lambda c: None)

    with pytest.raises(TypeError, match="non-empty"):
        PluginHost(extra_plugins={"badname": BadName()}).kv_stores()


def test_every_registry_facade_collects_its_own_hook(installed):
    class Everything:
        @hookimpl
        def deepinfer_register_protocols(self, register):
            register("acme.proto", lambda: "codec")

        @hookimpl
        def deepinfer_register_prompt_encodings(self, register):
            register("acme.enc", lambda: "encoding")

        @hookimpl
        def deepinfer_register_output_parsers(self, register):
            register("acme.parser", lambda options: "parser")

        @hookimpl
        def deepinfer_register_spec_policies(self, register_drafter):
            register_drafter("acme.drafter", lambda options: "drafter")

        @hookimpl
        def deepinfer_register_models(self, register_source):
            register_source("acme-model", lambda: None)

    host = PluginHost(extra_plugins={"everything": Everything()})
    assert host.protocols()["acme.proto"]() == "codec"
    assert host.prompt_encodings()["acme.enc"]() == "encoding"
    assert host.output_parsers()["acme.parser"]({}) == "parser"
    assert host.drafters()["acme.drafter"]({}) == "drafter"
    assert {"fixed", "confidence"} <= set(host.verification_policies())
    assert "acme.drafter" not in host.verification_policies()
    assert host.model_sources()["acme-model"]() is None
    assert "acme-model" not in host.models()


def test_open_unknown_kv_store_names_the_installed_ones(installed):
    with pytest.raises(NoImplementationError, match="memory"):
        PluginHost().open_kv_store("nope", None)


# -- platforms ----------------------------------------------------------------------------
def test_two_installed_plugins_claiming_one_device_conflict(installed):
    installed.extend(
        [FakeEntryPoint("vendor_a", DevicePlugin("cuda")), FakeEntryPoint("vendor_b", DevicePlugin("cuda"))]
    )
    with pytest.raises(PluginConflictError) as err:
        PluginHost().platform("cuda")
    assert "vendor_a" in str(err.value) and "vendor_b" in str(err.value)


def test_installed_platform_wins_over_builtin_and_over_cpu_on_auto(installed):
    host = PluginHost(extra_plugins={"vendor": DevicePlugin("npu")})
    assert host.platform("npu").name == "fake-npu"
    assert host.platform("auto").name == "fake-npu"
    assert host.platform("cpu").name == "cpu"


def test_unusable_platform_falls_back_on_auto_and_explains_when_asked(installed):
    host = PluginHost(extra_plugins={"vendor": DevicePlugin("npu", usable=False)})
    assert host.platform("auto").name == "cpu"
    with pytest.raises(NoImplementationError, match="fake device absent"):
        host.platform("npu")


def test_two_plugins_with_one_name_conflict(installed):
    installed.append(FakeEntryPoint("dup", StorePlugin("x")))
    with pytest.raises(PluginConflictError, match="dup"):
        PluginHost(extra_plugins={"dup": StorePlugin("y")}).pm


def test_same_plugin_object_under_two_names_is_reported_not_fatal(installed):
    plugin = StorePlugin("twice-store")
    installed.extend([FakeEntryPoint("first", plugin), FakeEntryPoint("second", plugin)])
    host = PluginHost()
    assert "twice-store" in host.kv_stores()
    infos = {i.name: i for i in host.plugins()}
    assert infos["first"].usable
    assert not infos["second"].usable and "already registered" in infos["second"].reason.lower()


def test_probes_are_asked_once_per_host_unless_refreshed(installed):
    calls = []

    class Counting:
        @hookimpl
        def deepinfer_probe(self):
            calls.append(1)
            return ProbeResult(True)

    host = PluginHost(extra_plugins={"counting": Counting()})
    host.plugins(), host.plugins()
    assert len(calls) == 1
    host.plugins(refresh=True)
    assert len(calls) == 2


@pytest.mark.parametrize(
    "answer, usable, reason",
    [((False, "no ACME card"), False, "no ACME card"), (True, True, ""), (None, False, "expected a ProbeResult")],
)
def test_probe_answers_that_are_not_probe_results_are_tolerated(installed, answer, usable, reason):
    class Odd:
        @hookimpl
        def deepinfer_probe(self):
            return answer

    info = {i.name: i for i in PluginHost(extra_plugins={"odd": Odd()}).plugins()}["odd"]
    assert info.usable is usable and reason in info.reason


def test_plugin_guide_documents_every_hook():
    from pathlib import Path

    from deepinfer_core.testing.hooks import hookspec_functions

    guide = (Path(__file__).resolve().parents[1] / "docs" / "writing-plugins.md").read_text(encoding="utf-8")
    assert [h for h in hookspec_functions() if f"`{h}(" not in guide] == []
