"""The plugin host: discovers plugins, and is the typed facade the engine calls.

Engine code never writes ``pm.hook.x(**kw)``; it calls :class:`PluginHost` methods, which say
what they return. Loading is lazy (first use) and idempotent, and every process builds its own
host, so worker processes are safe.

Precedence: builtins (``deepinfer_core.builtin``) are registered with ``trylast`` hooks, so an
installed plugin wins for firstresult hooks; for registries a plugin's entry replaces a builtin
one of the same name. Two *installed* plugins claiming the same device or registry name is an
error naming both.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from . import envs, hookspecs
from .platform import Platform, PlatformRequest, ProbeResult

try:  # Python < 3.12 ships an older importlib.metadata
    import importlib_metadata as metadata
except ImportError:  # pragma: no cover
    from importlib import metadata  # type: ignore[no-redef]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "deepinfer"
ALLOW_ENV = "DEEPINFER_PLUGINS"


class PluginConflictError(RuntimeError):
    """Two installed plugins claim the same device or the same registry name."""


class PluginContractError(RuntimeError):
    """A plugin's object breaks the contract in a way the host can see (a malformed capability
    declaration)."""


class NoImplementationError(LookupError):
    """No plugin (builtin included) provides what was asked for."""


class UnknownBackendError(NoImplementationError, ValueError):
    """A backend was asked for by a name no installed plugin has (bad input: a ValueError too)."""


BUILTIN_BACKEND = "builtin"  # names the core's reference backends in attention_backend=/moe_backend=
_BACKEND_HOOKS = {
    "attention": "deepinfer_attention_backend",
    "moe": "deepinfer_moe_dispatcher",
    "weight format": "deepinfer_weight_format",
}


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    builtin: bool
    hooks: list[str] = field(default_factory=list)
    probe: ProbeResult | None = None
    error: str | None = None  # import or validation failure; the plugin is not in use
    # the contract version the plugin declares it was built for (hookspecs.CONTRACT_ATTRIBUTE;
    # undeclared: 1, the contract before versions were declared); None when it did not load
    contract: int | None = None
    note: str = ""  # e.g. that its contract version is deprecated

    @property
    def usable(self) -> bool:
        return self.error is None and (self.probe is None or self.probe.usable)

    @property
    def reason(self) -> str:
        if self.error:  # a blocked builtin still says what it would do here (its probe)
            return self.error if self.probe is None or not self.probe.reason else f"{self.error}; {self.probe.reason}"
        return "" if self.probe is None else self.probe.reason


def allowed_plugins() -> set[str] | None:
    """Installed plugins named in ``DEEPINFER_PLUGINS`` (comma separated), or None when it names
    none to allow: unset, or only names to block (all installed plugins load)."""
    names = envs.get(ALLOW_ENV)
    if names is None:
        return None
    allowed = {name for name in names if not name.startswith("-")}
    return None if names and not allowed else allowed


def blocked_plugins() -> set[str]:
    """Plugins ``DEEPINFER_PLUGINS`` blocks with a leading ``-`` (``-core.lowbit``): builtins too."""
    return {name[1:].strip() for name in envs.get(ALLOW_ENV) or () if name.startswith("-")}


class PluginHost:
    def __init__(
        self,
        *,
        load_entry_points: bool = True,
        extra_plugins: dict[str, Any] | None = None,
        blocked: tuple[str, ...] = (),
    ) -> None:
        """``blocked``: plugin names never registered (builtins included, e.g. ``"core.lowbit"``),
        beside the ones ``DEEPINFER_PLUGINS`` blocks; ``deepinfer plugins`` lists them as such."""
        self._load_entry_points = load_entry_points
        self._extra = dict(extra_plugins or {})
        self._blocked = set(blocked)
        self._blocked_builtins: dict[str, Any] = {}  # name -> module, for its probe in plugins()
        self._pm: pluggy.PluginManager | None = None
        self._infos: dict[str, PluginInfo] = {}
        self._registries: dict[str, dict[str, Any]] = {}
        self._platform_probes: dict[tuple[str, str], ProbeResult] = {}  # probes can be slow

    # -- loading ----------------------------------------------------------------------------
    @property
    def pm(self) -> pluggy.PluginManager:
        if self._pm is None:
            self._pm = self._load()
        return self._pm

    def _load(self) -> pluggy.PluginManager:
        from .builtin import BUILTIN_PLUGINS, core_version

        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        for name, module in BUILTIN_PLUGINS.items():
            self._register(pm, name, module, "deepinfer-core", core_version(), builtin=True)
        if self._load_entry_points:
            allow = allowed_plugins()
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                if allow is not None and ep.name not in allow:
                    continue
                dist = ep.dist.name if ep.dist else "?"
                version = ep.dist.version if ep.dist else "?"
                try:
                    plugin = ep.load()
                except Exception as exc:  # reported, never fatal
                    log.warning("deepinfer plugin %r failed to import: %s", ep.name, exc)
                    self._infos[ep.name] = PluginInfo(ep.name, dist, version, False, error=f"import failed: {exc!r}")
                    continue
                self._register(pm, ep.name, plugin, dist, version, builtin=False)
        for name, plugin in self._extra.items():
            self._register(pm, name, plugin, "(in-process)", "", builtin=False)
        return pm

    def _register(self, pm, name, plugin, dist, version, *, builtin: bool) -> None:
        if name in self._infos and self._infos[name].error is None:
            raise PluginConflictError(f"two plugins are named {name!r} ({self._infos[name].distribution} and {dist})")
        info = PluginInfo(name, dist, version, builtin)
        if name in self._blocked or name in blocked_plugins():
            by = f"{ALLOW_ENV}=-{name}" if name in blocked_plugins() else "the host's block list"
            info.error = f"blocked by {by}"
            self._infos[name] = info
            if builtin:
                self._blocked_builtins[name] = plugin
            return
        try:
            info.contract, info.note = (hookspecs.CONTRACT_VERSION, "") if builtin else plugin_contract(plugin, name)
            pm.register(plugin, name=name)
            unknown = []
            for hook_name, caller in vars(pm.hook).items():
                if not caller.has_spec() and any(impl.plugin is plugin for impl in caller.get_hookimpls()):
                    unknown.append(hook_name)
            if unknown:
                pm.unregister(plugin)
                raise pluggy.PluginValidationError(plugin, f"unknown hook(s) {sorted(unknown)}: misspelled?")
        except (pluggy.PluginValidationError, ValueError, PluginContractError) as exc:  # ValueError: registered twice
            log.warning("deepinfer plugin %r rejected: %s", name, exc)
            info.error = f"invalid plugin: {exc}"
            self._infos[name] = info
            return
        info.hooks = sorted(c.name for c in pm.get_hookcallers(plugin) or [])
        self._infos[name] = info

    def is_builtin(self, plugin_name: str) -> bool:
        return self._infos[plugin_name].builtin

    # -- status -----------------------------------------------------------------------------
    def plugins(self, refresh: bool = False) -> list[PluginInfo]:
        """Every discovered plugin, with its probe answer (asked once per host unless
        ``refresh``) for the ones that loaded."""
        pm = self.pm
        for impl in pm.hook.deepinfer_probe.get_hookimpls():
            info = self._infos[impl.plugin_name]
            if info.probe is not None and not refresh:
                continue
            try:
                info.probe = as_probe_result(impl.function())
            except Exception as exc:
                info.probe = ProbeResult(False, f"probe raised {exc!r}")
        for name, plugin in self._blocked_builtins.items():  # core code: safe to ask while blocked
            probe = getattr(plugin, "deepinfer_probe", None)
            if probe is not None and (self._infos[name].probe is None or refresh):
                self._infos[name].probe = as_probe_result(probe())
        return sorted(self._infos.values(), key=lambda i: (not i.builtin, i.name))

    # -- platform ---------------------------------------------------------------------------
    def platform(self, device: str = "auto") -> Platform:
        """The platform for ``device``; raises when none is usable or two plugins conflict."""
        request = PlatformRequest(device)
        offers: list[tuple[str, Platform]] = []
        for impl in self.pm.hook.deepinfer_platform.get_hookimpls():
            platform = impl.function(request=request)
            if platform is not None:
                offers.append((impl.plugin_name, platform))
        by_type: dict[str, list[tuple[str, Platform]]] = {}
        for plugin_name, platform in offers:
            by_type.setdefault(platform.device_type, []).append((plugin_name, platform))
        for device_type, claims in by_type.items():
            installed = [name for name, _ in claims if not self.is_builtin(name)]
            if len(installed) > 1:
                raise PluginConflictError(
                    f"plugins {installed[0]!r} and {installed[1]!r} both claim device type {device_type!r}; "
                    f"uninstall one or choose with {ALLOW_ENV}=..."
                )
        wanted = [request.device_type] if request.device_type != "auto" else list(by_type)
        ranked = sorted(
            (claim for t in wanted for claim in by_type.get(t, [])),
            key=lambda c: (self.is_builtin(c[0]), c[1].device_type == "cpu"),
        )
        reasons = []
        for plugin_name, platform in ranked:
            key = (plugin_name, platform.name)
            if key not in self._platform_probes:
                self._platform_probes[key] = platform.probe()
            probe = self._platform_probes[key]
            if probe.usable:
                return platform
            reasons.append(f"{platform.name} ({plugin_name}): {probe.reason}")
            if request.device_type != "auto":
                break
        if not ranked:
            raise NoImplementationError(f"no installed plugin provides device {device!r}")
        raise NoImplementationError(f"device {device!r} is not usable here: " + "; ".join(reasons))

    # -- hot-path objects ---------------------------------------------------------------------
    def attention_backend(self, layer, platform: Platform, name: str | None = None):
        """The attention backend for ``layer`` on ``platform``. ``name`` (a plugin name, or
        ``"builtin"``) asks that one plugin only; None asks every provider in
        :meth:`backend_providers` order and takes the first answer that can serve the layer by
        its declared capabilities (:func:`~deepinfer_core.attention.attention_unsupported`): an
        answer that cannot is passed over, so the layer goes to the next plugin or the builtin."""
        from .attention import attention_unsupported

        what = f"{layer.kind.value!r} layers" + (" (DeepSeek-V4 state KV)" if layer.state_kv else "")
        backend = self._first_answer(
            "deepinfer_attention_backend",
            "attention",
            name,
            lambda backend: attention_unsupported(backend, layer),
            f"attention layer {layer.layer_index} ({what})",
            layer=layer,
            platform=platform,
        )
        if backend is None:
            by = f" from {name!r}" if name else ""
            raise NoImplementationError(f"no attention backend{by} for {what} on platform {platform.name!r}")
        return backend

    def moe_dispatcher(self, moe, platform: Platform, parallel=None, name: str | None = None):
        """The MoE dispatcher for ``moe`` on ``platform``; ``name`` as in :meth:`attention_backend`.
        A dispatcher is handed only layers its :class:`~deepinfer_core.moe.MoECapabilities` cover:
        a ``hash`` layer never goes to one that does not declare hash routing (one written for
        the previous contract), so such a dispatcher never receives ``token_ids=`` / ``hash_table=``."""
        from .moe import ParallelConfig, moe_capabilities

        dispatcher = self._first_answer(
            "deepinfer_moe_dispatcher",
            "moe",
            name,
            lambda dispatcher: moe_capabilities(dispatcher).unsupported(moe),
            f"MoE layer {moe.layer_index} (scoring {moe.scoring!r})",
            moe=moe,
            platform=platform,
            parallel=parallel or ParallelConfig(),
        )
        if dispatcher is None:
            by = f" from {name!r}" if name else ""
            raise NoImplementationError(
                f"no MoE dispatcher{by} for scoring {moe.scoring!r} on platform {platform.name!r}"
            )
        return dispatcher

    def decode_graphs(self, platform: Platform):
        """The platform's decode-graph factory (``deepinfer_decode_graphs``), or None: eager."""
        return self.pm.hook.deepinfer_decode_graphs(platform=platform)

    def batch_invariant_ops(self, platform: Platform):
        """The platform's batch-invariant op context factory (``deepinfer_batch_invariant_ops``), or None."""
        return self.pm.hook.deepinfer_batch_invariant_ops(platform=platform)

    def fused_ops(self, platform: Platform):
        """The platform's fused elementwise kernels (``deepinfer_fused_ops``), or None."""
        return self.pm.hook.deepinfer_fused_ops(platform=platform)

    def weight_format(self, weights, platform: Platform, name: str | None = None):
        """The weight format for a checkpoint (``deepinfer_weight_format``), or None: dense
        weights. Providers are asked in :meth:`backend_providers` order (``name``: that plugin
        only, or ``"builtin"``); the first usable answer wins, else the first answer that claims
        the weights but is unavailable here (its ``unavailable`` says why)."""
        self.check_backend_name("weight format", name)
        impls = {impl.plugin_name: impl for impl in self.pm.hook.deepinfer_weight_format.get_hookimpls()}
        order = self.backend_providers("deepinfer_weight_format")
        if name == BUILTIN_BACKEND:
            order = [n for n in order if self.is_builtin(n)]
        elif name is not None:
            order = [name]
        fallback = None
        for plugin_name in order:
            impl = impls[plugin_name]
            answer = impl.function(**{arg: {"weights": weights, "platform": platform}[arg] for arg in impl.argnames})
            if answer is not None and answer.unavailable is None:
                return answer
            if fallback is None:
                fallback = answer
        return fallback

    def fused_decode_step(self, model, platform: Platform):
        """A whole-step implementation of ``model`` (``deepinfer_fused_decode_step``), or None."""
        return self.pm.hook.deepinfer_fused_decode_step(model=model, platform=platform)

    def backend_providers(self, hook_name: str) -> list[str]:
        """Plugins implementing ``hook_name`` in the order they are asked when no backend is
        named: installed plugins by name (alphabetical, so the order never depends on how
        entry points happen to be listed), then the builtins."""
        names = [impl.plugin_name for impl in getattr(self.pm.hook, hook_name).get_hookimpls()]
        return sorted(n for n in names if not self.is_builtin(n)) + sorted(n for n in names if self.is_builtin(n))

    def check_backend_name(self, kind: str, name: str | None) -> None:
        """Raise :class:`UnknownBackendError` listing the choices when ``name`` names no
        provider of ``kind`` (``"attention"`` or ``"moe"``); None always passes."""
        if name is None:
            return
        hook_name = _BACKEND_HOOKS[kind]
        providers = self.backend_providers(hook_name)
        if name != BUILTIN_BACKEND and name not in providers:
            installed = [n for n in providers if not self.is_builtin(n)]
            choices = ", ".join([*installed, BUILTIN_BACKEND])
            raise UnknownBackendError(f"unknown {kind} backend {name!r}; available: {choices}")

    def _first_answer(
        self,
        hook_name: str,
        kind: str,
        name: str | None,
        unsupported: Callable[[Any], str | None],
        what: str,
        **kwargs: Any,
    ) -> Any:
        """The first answer, in provider order, that ``unsupported(answer)`` accepts (None). A
        plugin named by ``name`` whose answer cannot serve the layer is an error saying why."""
        self.check_backend_name(kind, name)
        impls = {impl.plugin_name: impl for impl in getattr(self.pm.hook, hook_name).get_hookimpls()}
        order = self.backend_providers(hook_name)
        if name == BUILTIN_BACKEND:
            order = [n for n in order if self.is_builtin(n)]
        elif name is not None:
            order = [name]
        for plugin_name in order:
            impl = impls[plugin_name]
            answer = impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
            if answer is None:
                continue
            try:
                reason = unsupported(answer)
            except TypeError as exc:  # a malformed declaration
                raise PluginContractError(f"plugin {plugin_name!r}: {exc}") from None
            if reason is None:
                return answer
            label = getattr(answer, "name", type(answer).__name__)
            if name is not None and name != BUILTIN_BACKEND:
                raise NoImplementationError(
                    f"{kind} backend {name!r} cannot serve {what} ({label!r}: {reason}); "
                    f"leave the {kind} backend unset to let the host route such layers"
                )
            log.debug("%s: passing over plugin %r (%r %s)", what, plugin_name, label, reason)
        return None

    # -- registries -------------------------------------------------------------------------
    def _registry(self, hook_name: str, arg: str) -> dict[str, Any]:
        key = f"{hook_name}:{arg}"
        if key not in self._registries:
            self._registries[key] = self._collect(hook_name, arg)
        return self._registries[key]

    def _collect(self, hook_name: str, arg: str) -> dict[str, Any]:
        entries: dict[str, tuple[str, Any]] = {}
        caller = getattr(self.pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            owner = impl.plugin_name
            if arg not in impl.argnames:
                continue

            def register(name: str, factory: Any, _owner: str = owner) -> None:
                if not isinstance(name, str) or not name:
                    raise TypeError(f"plugin {_owner!r}: registry names must be non-empty strings, got {name!r}")
                if not callable(factory):
                    raise TypeError(f"plugin {_owner!r}: factory for {name!r} is not callable")
                previous = entries.get(name)
                if previous is not None and not self.is_builtin(previous[0]):
                    if self.is_builtin(_owner):
                        return  # an installed plugin already overrides this builtin
                    raise PluginConflictError(
                        f"plugins {previous[0]!r} and {_owner!r} both register {name!r} ({hook_name})"
                    )
                entries[name] = (_owner, factory)

            kwargs = {name: (register if name == arg else _ignore) for name in impl.argnames}
            impl.function(**kwargs)
        return {name: factory for name, (_owner, factory) in entries.items()}

    def registry_owner(self, hook_name: str, arg: str, name: str) -> str:
        """Which plugin's entry won for ``name`` (for messages and tests)."""
        self._registry(hook_name, arg)
        caller = getattr(self.pm.hook, hook_name)
        owner = None
        for impl in caller.get_hookimpls():
            if arg not in impl.argnames:
                continue
            found: list[str] = []
            kwargs = {
                a: ((lambda n, f, _found=found: _found.append(n)) if a == arg else _ignore) for a in impl.argnames
            }
            impl.function(**kwargs)
            if name in found and (owner is None or self.is_builtin(owner)):
                owner = impl.plugin_name
        if owner is None:
            raise KeyError(name)
        return owner

    def kv_stores(self) -> dict[str, Callable]:
        return self._registry("deepinfer_register_kv_stores", "register")

    def protocols(self) -> dict[str, Callable]:
        return self._registry("deepinfer_register_protocols", "register")

    def prompt_encodings(self) -> dict[str, Callable]:
        return self._registry("deepinfer_register_prompt_encodings", "register")

    def output_parsers(self) -> dict[str, Callable]:
        return self._registry("deepinfer_register_output_parsers", "register")

    def drafters(self) -> dict[str, Callable]:
        return self._registry("deepinfer_register_spec_policies", "register_drafter")

    def verification_policies(self) -> dict[str, Callable]:
        return self._registry("deepinfer_register_spec_policies", "register_verification")

    def models(self) -> dict[str, Callable]:
        return self._registry("deepinfer_register_models", "register")

    def model_sources(self) -> dict[str, Callable]:
        return self._registry("deepinfer_register_models", "register_source")

    def open_kv_store(self, name: str, config):
        stores = self.kv_stores()
        if name not in stores:
            raise NoImplementationError(f"unknown KV store {name!r}; installed: {', '.join(sorted(stores))}")
        return stores[name](config)


def plugin_contract(plugin: Any, name: str) -> tuple[int, str]:
    """``(contract version, note)`` of a plugin module or object: its
    :data:`~deepinfer_core.hookspecs.CONTRACT_ATTRIBUTE` (undeclared: 1). Raises
    :class:`PluginContractError` for a version this core does not serve; the note says when a
    served one is deprecated."""
    declared = getattr(plugin, hookspecs.CONTRACT_ATTRIBUTE, 1)
    if type(declared) is not int:
        raise PluginContractError(f"{hookspecs.CONTRACT_ATTRIBUTE} must be an int, got {declared!r}")
    served = f"this deepinfer-core serves contracts {hookspecs.OLDEST_CONTRACT_VERSION}-{hookspecs.CONTRACT_VERSION}"
    if declared > hookspecs.CONTRACT_VERSION:
        raise PluginContractError(f"built for contract {declared}; {served}: upgrade deepinfer-core")
    if declared < hookspecs.OLDEST_CONTRACT_VERSION:
        raise PluginContractError(f"built for contract {declared}; {served}: upgrade the plugin")
    note = ""
    if declared in hookspecs.DEPRECATED_CONTRACTS:
        note = f"contract {declared} is deprecated: {hookspecs.DEPRECATED_CONTRACTS[declared]}"
        log.warning("deepinfer plugin %r: %s", name, note)
    return declared, note


def as_probe_result(answer) -> ProbeResult:
    """A probe should return :class:`ProbeResult`; a ``bool`` or ``(usable, reason)`` pair is
    accepted, anything else is reported as the plugin's mistake rather than crashing the host."""
    if isinstance(answer, ProbeResult):
        return answer
    if isinstance(answer, bool):
        return ProbeResult(answer, "" if answer else "probe said no")
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool):
        return ProbeResult(answer[0], str(answer[1]))
    return ProbeResult(False, f"probe returned {answer!r}, expected a ProbeResult")


def _ignore(*_args, **_kwargs) -> None:
    return None


@functools.cache
def default_host() -> PluginHost:
    """The process's host (built on first use; each worker process builds its own)."""
    return PluginHost()
