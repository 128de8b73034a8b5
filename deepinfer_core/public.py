"""The public surface for plugin authors: the one list of what a plugin may import.

A plugin's package imports only the modules in :data:`PUBLIC_MODULES`, and from each only the
names in that module's ``__all__`` (docs/writing-plugins.md, "The public surface"). Everything
else in ``deepinfer_core`` is internal and may change in any release.
``tests/test_public_surface.py`` scans every plugin package's imports (inside functions too)
against this list, and the ``.importlinter`` contract "plugins import only the public surface"
forbids the rest (:func:`internal_roots` computes its module list).

What the list holds, on purpose:

- the contract: ``hookspecs`` and the modules of the protocols and frozen specs it names;
- the reference kernels that plugins reuse or subclass: the torch attention backends
  (``attention.torch_ref``, ``attention.v4_ref``) and MoE dispatcher (``moe.torch_ref``), the KV
  record format (``kv_store.records``) and the local store as a base class
  (``kv_store.local.LocalDiskKVStore``), the compiled-helper cache (``build_cache``), the EPLB
  planner and its placement tables (``parallel.eplb``);
- the table of environment variables (``envs``), through which a plugin reads its own;
- ``deepinfer_core`` itself (the end-user API: ``LLM``, ``SamplingParams``);
- the conformance suites and their helpers (``deepinfer_core.testing`` and its modules), for a
  plugin's tests.

A plugin's *tests* may also drive the engine end to end (:data:`TEST_MODULES`); those modules
are public for tests only, not for a plugin's package.
"""

from __future__ import annotations

__all__ = ["PUBLIC_MODULES", "TEST_MODULES", "internal_roots", "is_public", "module_of"]

PUBLIC_MODULES: tuple[str, ...] = (
    "deepinfer_core",
    "deepinfer_core.public",
    # the contract
    "deepinfer_core.hookspecs",
    "deepinfer_core.platform",
    "deepinfer_core.attention",
    "deepinfer_core.moe",
    "deepinfer_core.kv_store",
    "deepinfer_core.codecs",
    "deepinfer_core.fused_ops",
    "deepinfer_core.speculative",
    "deepinfer_core.causal_lm",
    "deepinfer_core.decode_graphs",
    "deepinfer_core.weight_format",
    "deepinfer_core.models",  # re-exports causal_lm's names
    "deepinfer_core.models.sources",
    # reference kernels and helpers, reusable on purpose
    "deepinfer_core.attention.torch_ref",
    "deepinfer_core.attention.v4_ref",
    "deepinfer_core.moe.torch_ref",
    "deepinfer_core.moe.ep",
    "deepinfer_core.kv_store.records",
    "deepinfer_core.kv_store.local",
    "deepinfer_core.build_cache",
    "deepinfer_core.parallel",
    "deepinfer_core.parallel.eplb",  # expert placement tables a plugin's EP dispatcher reads
    "deepinfer_core.parallel.load",  # ModelContext.expert_load's type: a plugin's model feeds it
    "deepinfer_core.envs",  # DEEPINFER_* variables: a plugin reads (and declares) its own through the table
    # conformance suites and test helpers
    "deepinfer_core.testing",
    "deepinfer_core.testing.attention",
    "deepinfer_core.testing.attention_shared",
    "deepinfer_core.testing.codecs",
    "deepinfer_core.testing.ep",
    "deepinfer_core.testing.gguf_files",
    "deepinfer_core.testing.greedy_check",
    "deepinfer_core.testing.hooks",
    "deepinfer_core.testing.host_sync",
    "deepinfer_core.testing.kv_store",
    "deepinfer_core.testing.models",
    "deepinfer_core.testing.moe",
    "deepinfer_core.testing.paged_batch",
    "deepinfer_core.testing.platform",
    "deepinfer_core.testing.speculative",
    "deepinfer_core.testing.v3_checkpoint",
    "deepinfer_core.testing.v4_attention",
    "deepinfer_core.testing.v4_checkpoint",
    "deepinfer_core.testing.v4_tiny",
    "deepinfer_core.testing.weight_format",
)

# Plugin tests only: the engine and the server end to end, and the host that finds plugins.
TEST_MODULES: tuple[str, ...] = (
    "deepinfer_core.engine",
    "deepinfer_core.plugin_host",
    "deepinfer_core.serve",
)


def module_of(name: str) -> str:
    """``deepinfer_core.a.b`` for ``deepinfer_core.a.b`` or any module below it among the test
    modules; the module itself otherwise."""
    for root in TEST_MODULES:
        if name == root or name.startswith(root + "."):
            return root
    return name


def is_public(module: str, *, tests: bool = False) -> bool:
    """Whether a plugin (``tests``: a plugin's tests) may import ``module``."""
    return module in PUBLIC_MODULES or (tests and module_of(module) in TEST_MODULES)


def internal_roots(modules: list[str]) -> list[str]:
    """The smallest set of ``deepinfer_core`` modules that covers, with everything below them,
    every internal module among ``modules`` (all modules of the package) and no public one: the
    ``forbidden_modules`` of the import-linter contract."""
    public = set(PUBLIC_MODULES)

    def has_public_below(name: str) -> bool:
        return any(p == name or p.startswith(name + ".") for p in public)

    roots = []
    for name in sorted(modules):
        if has_public_below(name):
            continue  # public itself, or a package with public modules below it
        parent = name.rpartition(".")[0]
        if parent and not has_public_below(parent):
            continue  # covered by an internal package above it
        roots.append(name)
    return roots


def importlinter_section(plugin_packages: list[str]) -> str:
    """The ``.importlinter`` contract "plugins import only the public surface" for
    ``plugin_packages``, with today's internal modules (``python -m deepinfer_core.public``)."""
    import pkgutil

    import deepinfer_core

    modules = ["deepinfer_core", *(m.name for m in pkgutil.walk_packages(deepinfer_core.__path__, "deepinfer_core."))]
    lines = [
        "[importlinter:contract:plugins-public-surface]",
        "name = plugins import only the public surface (deepinfer_core/public.py)",
        "type = forbidden",
        "# direct imports only: a public module may itself use internal ones",
        "allow_indirect_imports = True",
        "source_modules =",
        *(f"    {p}" for p in plugin_packages),
        "forbidden_modules =",
        *(f"    {m}" for m in internal_roots(modules)),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    plugins = ["deepinfer_3fs", "deepinfer_acme", "deepinfer_ascend950", "deepinfer_cuda_sm100", "deepinfer_recipe"]
    print(importlinter_section(plugins))
