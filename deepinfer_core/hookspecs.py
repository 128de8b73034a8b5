"""The deepinfer hook specifications: the whole contract between the core and its plugins.

pluggy is used for discovery and configuration only. Every hook is called a handful of times
per process (at start-up or when a model/server is built), never per token: each returns a typed
object that the engine then calls directly on the hot path.

A plugin is a module (or object) with functions decorated by :data:`hookimpl`, exposed through
an entry point in the group ``deepinfer``::

    [project.entry-points.deepinfer]
    my_vendor = "my_vendor_plugin"

Builtins are registered the same way, marked ``trylast``, so any installed plugin wins.
Hooks marked *firstresult* stop at the first non-None result; registry hooks are called on
every plugin and receive a ``register`` callback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ContextManager

import pluggy

if TYPE_CHECKING:
    from .attention import AttentionBackend, AttentionLayerSpec
    from .causal_lm import CausalLM, FusedDecodeStep, ModelFactory, ModelSource
    from .codecs import OutputParserFactory, PromptEncodingFactory, ProtocolCodecFactory
    from .decode_graphs import DecodeGraphsFactory
    from .fused_ops import FusedOps
    from .kv_store import KVStoreFactory
    from .moe import MoEDispatcher, MoESpec, ParallelConfig
    from .platform import Platform, PlatformRequest, ProbeResult
    from .speculative import DrafterFactory, VerificationPolicyFactory
    from .weight_format import WeightFormat, WeightsRequest

__all__ = [
    "CONTRACT_ATTRIBUTE",
    "CONTRACT_VERSION",
    "DEPRECATED_CONTRACTS",
    "OLDEST_CONTRACT_VERSION",
    "PROJECT",
    "hookimpl",
    "hookspec",
]


PROJECT = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# Contract versions (docs/writing-plugins.md, "Compatibility"). A plugin's entry-point module
# declares the version it was built for as ``DEEPINFER_CONTRACT = 2``; one that declares none
# was built for contract 1. The host loads plugins of OLDEST_CONTRACT_VERSION..CONTRACT_VERSION
# and lists the version in ``deepinfer plugins``; others are listed as unusable, saying why.
#   1: the hooks below; MoEDispatcher.select_experts(spec, router_logits, correction_bias=None).
#   2: capability declarations (MoECapabilities: hash routing with token_ids= / hash_table=,
#      the scorings; AttentionCapabilities: layer kinds), and this version attribute.
CONTRACT_VERSION = 2
OLDEST_CONTRACT_VERSION = 1
CONTRACT_ATTRIBUTE = "DEEPINFER_CONTRACT"
# version -> what happens to it and when (e.g. "not loaded from deepinfer-core 0.4"); a version
# is listed here for at least one minor release before OLDEST_CONTRACT_VERSION passes it.
DEPRECATED_CONTRACTS: dict[int, str] = {}


# ---------------------------------------------------------------------------------------------
# plugin status
# ---------------------------------------------------------------------------------------------
@hookspec
def deepinfer_probe() -> ProbeResult:
    """Say whether this plugin is usable on this machine, from a real probe.

    Called by ``deepinfer plugins`` (through ``PluginHost.plugins()``) once per plugin, each
    implementation on its own, so the answer is attributed to the plugin that gave it.

    The answer is a report, not a switch: a plugin whose probe says no stays registered and its
    other hooks are still called. Whether a *device* is used is decided by the probe of the
    :class:`~deepinfer_core.platform.Platform` that ``deepinfer_platform`` returns, and kernel
    hooks must decline (return None) for platforms they do not drive.

    Must never raise or break the host process (probe risky imports in a subprocess).

    :return: ``ProbeResult(True)``, or ``ProbeResult(False, reason)`` with a short reason such
        as ``"no CUDA device"``, ``"compute capability 8.0 < 9.0"``, ``"torch_npu not
        importable"``, ``"no 3FS mount configured"``.
    """


# ---------------------------------------------------------------------------------------------
# platform
# ---------------------------------------------------------------------------------------------
@hookspec
def deepinfer_platform(request: PlatformRequest) -> Platform | None:
    """Offer a platform for the device the user asked for.

    Called by ``PluginHost.platform()`` when an engine is built. Every plugin is asked (not
    firstresult) so that the host can detect conflicts: if two non-builtin plugins return a
    platform for the same ``device_type``, start-up fails with an error naming both.
    ``request.device_type == "auto"`` asks for the best usable device.

    :param request: the device requested (``"auto"``, ``"cpu"``, ``"cuda:0"``...).
    :return: a :class:`~deepinfer_core.platform.Platform` whose ``device_type`` matches the
        request (any, for ``"auto"``), or None when this plugin does not drive that device.
        Return a platform even when its probe fails: the host reports the reason.
    """


@hookspec(firstresult=True)
def deepinfer_attention_backend(layer: AttentionLayerSpec, platform: Platform) -> AttentionBackend | None:
    """Provide the attention implementation for one attention layer kind on one platform.

    Called by the model builder once per distinct layer spec while the model is constructed;
    the engine then calls ``backend.forward`` directly every step. ``PluginHost`` asks the
    installed plugins in name order, then the builtins, and stops at the first non-None
    result that can serve the layer: an answer whose ``capabilities``
    (:class:`~deepinfer_core.attention.AttentionCapabilities`) do not cover the layer's kind is
    passed over, so the layer goes to the next plugin or the builtin; an answer declaring none
    serves what it is returned for (contract 1), but a DeepSeek-V4 layer only with ``forward_v4``.
    ``LLM(attention_backend=NAME)`` asks plugin NAME only (``"builtin"``: the core's). The builtin
    torch reference answers last for every kind it supports.

    :param layer: frozen spec: ``kind`` (full | mla | sliding | compressed_sparse |
        heavily_compressed), head counts and sizes, window, compression, dtypes.
    :param platform: the platform the model runs on.
    :return: an :class:`~deepinfer_core.attention.AttentionBackend`, or None when this plugin
        has no implementation for this layer kind on this platform.
    """


@hookspec(firstresult=True)
def deepinfer_moe_dispatcher(moe: MoESpec, platform: Platform, parallel: ParallelConfig) -> MoEDispatcher | None:
    """Provide expert routing, expert compute and the expert-parallel exchange for a MoE layer.

    Called by the model builder once per MoE layer spec; the engine then calls
    ``select_experts`` and ``forward`` directly. Asked in the same order as
    ``deepinfer_attention_backend`` (``LLM(moe_backend=NAME)`` asks NAME only); stops at the
    first non-None result whose ``capabilities`` (:class:`~deepinfer_core.moe.MoECapabilities`)
    cover the layer: a ``hash`` layer goes only to a dispatcher declaring ``hash_routing``, the
    only kind ever called with ``token_ids=`` / ``hash_table=``. A dispatcher declaring nothing is
    a contract-1 dispatcher: the learned scorings, no hash routing.

    :param moe: frozen spec: experts, top-k, scoring, groups, widths, clamp.
    :param platform: the platform the model runs on.
    :param parallel: tensor/expert/data parallel sizes and this rank.
    :return: a :class:`~deepinfer_core.moe.MoEDispatcher`, or None when not applicable.
    """


@hookspec(firstresult=True)
def deepinfer_decode_graphs(platform: Platform) -> DecodeGraphsFactory | None:
    """Offer a graph-capture policy for decode steps on this platform (e.g. CUDA graphs).

    Called by ``PluginHost.decode_graphs()`` once when an engine is built, unless the engine
    runs eagerly (``LLM(enforce_eager=True)``) or batch-invariant. The engine then reserves one
    scratch KV block (index ``num_blocks``, never handed to a request: padded rows write there)
    and calls ``factory(model, kv_caches, block_size=, scratch_block=, max_num_seqs=,
    max_blocks=)`` once; the returned :class:`~deepinfer_core.decode_graphs.DecodeGraphs`
    captures what it wants at start-up and is offered every pure-decode step
    (``run(input_ids, meta)``; None means "run it eagerly"). Prefill and mixed steps are eager.

    :param platform: the platform the engine runs on.
    :return: a factory as above, or None (the builtin answers None: eager everywhere).
    """


@hookspec(firstresult=True)
def deepinfer_batch_invariant_ops(platform: Platform) -> Callable[[], ContextManager] | None:
    """Offer batch-invariant versions of the ops a model calls directly (matmuls, reductions).

    Called by ``PluginHost.batch_invariant_ops()`` once when a ``batch_invariant=True`` engine
    is built. The runner enters ``factory()`` around each step's forward and logits, so a
    request's numbers never depend on the other rows of its batch: attention and MoE backends
    already see ``meta.batch_invariant``; this covers the dense layers (GPU matmul libraries
    choose kernels by the number of rows). A ``TorchDispatchMode`` is one way to provide it.

    :param platform: the platform the engine runs on.
    :return: a zero-argument callable returning a context manager, or None (the builtin: the
        CPU reference ops are used as they are).
    """


@hookspec(firstresult=True)
def deepinfer_fused_ops(platform: Platform) -> FusedOps | None:
    """Offer one-kernel versions of small elementwise chains: RMSNorm, SiLU-and-mul, and MLA's
    rotary embedding with the query / key concatenation; and ``fp8_linear``, a GEMM for FP8
    block-scaled weights. The loader also asks (``engine.loading.keep_fp8``): when the answer has
    ``fp8_linear``, a DeepSeek FP8 checkpoint's weights stay FP8 (``models.fp8``), also with
    ``LLM(fused_ops=False)``, where those modules then dequantize on every call. Likewise
    ``mxfp4_moe`` (routed experts on packed MXFP4 weights): DeepSeek-V4's MXFP4 routed experts
    stay packed (``engine.loading.keep_mxfp4``, ``models.mxfp4``).

    Called by ``PluginHost.fused_ops()`` once when an engine is built (not with
    ``LLM(fused_ops=False)``); the engine points the model's ``RMSNorm``, gated-MLP and MLA modules
    at the kernels (:func:`deepinfer_core.fused_ops.install`). Each kernel must compute what its
    reference in :mod:`deepinfer_core.fused_ops` computes (same shapes, dtypes and rounding
    order), row by row, so it is batch invariant, and it must not synchronise with the host
    (it runs inside captured decode graphs and overlapped steps).

    :param platform: the platform the engine runs on.
    :return: a :class:`~deepinfer_core.fused_ops.FusedOps` (fields left None keep the torch
        ops), or None (the builtin: the model's torch ops everywhere).
    """


# ---------------------------------------------------------------------------------------------
# weights and whole steps
# ---------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def deepinfer_weight_format(weights: WeightsRequest, platform: Platform) -> WeightFormat | None:
    """Offer a way to hold and multiply a checkpoint's weights (what vLLM calls a quantization
    method): the builtin ``core.lowbit`` keeps a block-quantized GGUF's tensors packed on CPU.

    Called by ``PluginHost.weight_format()`` once when an engine loads a model (and by
    ``deepinfer plan``), after the checkpoint is opened and before the model is built. Asked in
    the order of ``deepinfer_attention_backend`` (installed plugins by name, then the builtins;
    ``LLM(weight_format=NAME)`` asks NAME only); the host takes the first answer whose
    ``unavailable`` is None, else reports the first unavailable one's reason and loads dense.
    The engine then builds the model with the format's ``compute_dtype`` and
    ``kv_cache_dtype()``, passes each layer's chosen attention backend through
    ``attention_backend(layer, chosen)``, and loads ``weights(files)`` into a model
    ``prepare(model)`` swapped its modules into (:mod:`deepinfer_core.weight_format`).

    :param weights: the checkpoint's block-quantized tensor names and GGML types (a neutral
        description: the loader never packs) and the dtype / KV cache dtype the user asked for.
    :param platform: the platform the model runs on.
    :return: a :class:`~deepinfer_core.weight_format.WeightFormat` that claims these weights
        (with ``unavailable`` set when it claims them but cannot run here), or None when it
        does not claim them (dense weights).
    """


@hookspec(firstresult=True)
def deepinfer_fused_decode_step(model: CausalLM, platform: Platform) -> FusedDecodeStep | None:
    """Offer a whole-step implementation of a loaded model (the builtin ``core.lowbit``: one C
    call per step for a Llama-family model on packed low-bit weights), beside
    ``deepinfer_decode_graphs``: that one replays the model's own kernels, this one replaces them.

    Called by ``PluginHost.fused_decode_step()`` once when an engine is built, after the
    weights are loaded and the fused ops installed, for a model that has a ``fused_step``
    attribute; the engine sets it to the answer, and the model offers every step to
    ``step.run(input_ids, kv_caches, meta)`` first (None: the model's own layers run it). The
    step must compute what the model's forward computes, and decline what it cannot (replays,
    batch-invariant steps, shapes it does not handle).

    :param model: the loaded model (inspect its modules; decline any you do not know).
    :param platform: the platform the model runs on.
    :return: a :class:`~deepinfer_core.models.FusedDecodeStep`, or None (the model's forward).
    """


# ---------------------------------------------------------------------------------------------
# registries: called on every plugin with a ``register(name, factory)`` callback
# ---------------------------------------------------------------------------------------------
@hookspec
def deepinfer_register_kv_stores(register: Callable[[str, KVStoreFactory], None]) -> None:
    """Register KV storage backends by name.

    Called once when the host first builds its KV store catalogue (the engine opening a store,
    ``deepinfer plugins``). ``register(name, factory)`` where ``factory(KVStoreConfig) ->
    KVStore``. A later registration of the same name by a non-builtin plugin replaces a builtin;
    two non-builtin plugins registering one name is an error naming both.

    :return: None (results go through ``register``).
    """


@hookspec
def deepinfer_register_protocols(register: Callable[[str, ProtocolCodecFactory], None]) -> None:
    """Register HTTP API codecs (e.g. ``"openai.chat_completions"``, ``"anthropic.messages"``).

    Called once when the server is built. ``register(name, factory)`` with ``factory() ->
    ProtocolCodec``; the server mounts each codec's ``routes``.

    :return: None (results go through ``register``).
    """


@hookspec
def deepinfer_register_prompt_encodings(register: Callable[[str, PromptEncodingFactory], None]) -> None:
    """Register prompt encodings (conversation -> token ids) such as ``"deepseek_v4"``.

    Called once when a chat-capable engine is built; the engine picks the first registered
    encoding whose ``matches(model_config)`` is true, else the model's own chat template.
    ``register(name, factory)`` with ``factory() -> PromptEncoding``.

    :return: None (results go through ``register``).
    """


@hookspec
def deepinfer_register_output_parsers(register: Callable[[str, OutputParserFactory], None]) -> None:
    """Register incremental output parsers (reasoning / tool calls) by name.

    Called once when a chat-capable engine is built. ``register(name, factory)`` with
    ``factory(options: dict) -> OutputParser``; a prompt encoding names the parser its output
    needs.

    :return: None (results go through ``register``).
    """


@hookspec
def deepinfer_register_spec_policies(
    register_drafter: Callable[[str, DrafterFactory], None],
    register_verification: Callable[[str, VerificationPolicyFactory], None],
) -> None:
    """Register speculative-decoding drafters and verification policies by name.

    Called once when an engine with speculative decoding is built.
    ``register_drafter(name, factory)`` with ``factory(config: dict, ctx: DrafterContext) ->
    Drafter`` (``config``: the whole ``speculative_config``; its ``method`` names the drafter);
    ``register_verification(name, factory(options) -> VerificationPolicy)``. Builtins:
    verification policies ``"fixed"`` and ``"confidence"`` (DSpark). A plugin may register only
    one kind (declare only the argument it uses).

    :return: None (results go through the callbacks).
    """


@hookspec
def deepinfer_register_models(
    register: Callable[[str, ModelFactory], None],
    register_source: Callable[[str, ModelSource], None],
) -> None:
    """Register model architectures and model sources.

    Called once when the first model is resolved. ``register(architecture, factory)`` with
    the Hugging Face architecture name (``"LlamaForCausalLM"``, ``"DeepseekV3ForCausalLM"``)
    and ``factory(config: dict, ctx: ModelContext) -> CausalLM``.
    ``register_source(alias, resolve)`` names a model that an installed package ships:
    ``resolve()`` returns its local path, or None when it is not installed.

    :return: None (results go through the callbacks).
    """
