"""Resolve a model name to files, build the architecture through the plugin host, load weights."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from ..models import ModelContext
from ..models.fast_init import skip_random_init
from ..models.loaders.files import ModelFiles
from ..models.loaders.formats import open_model_files
from ..parallel.load import ExpertLoadCounter
from ..platform import Platform
from ..plugin_host import PluginHost
from ..weight_format import WeightFormat, WeightsRequest

log = logging.getLogger(__name__)


def resolve_model_path(name: str, host: PluginHost) -> str:
    """A filesystem path, or an alias registered by a model source (``smollm2-135m-instruct``)."""
    if os.path.exists(name):
        return name
    sources = host.model_sources()
    if name in sources:
        path = sources[name]()
        if path is None:
            doc = (sources[name].__doc__ or "").strip().splitlines()
            hint = f" ({' '.join(line.strip() for line in doc)})" if doc else ""
            raise ValueError(f"model {name!r} is a known alias but its files are not installed{hint}")
        return path
    known = ", ".join(sorted(sources)) or "none"
    raise ValueError(
        f"unknown model {name!r}: no such file or directory, and not a known alias (known aliases: {known})"
    )


def build_model(
    files: ModelFiles,
    host: PluginHost,
    platform: Platform,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str | None = None,
    moe_backend: str | None = None,
    weight_format: WeightFormat | None = None,
    parallel=None,
    prepare_model=None,
    expert_load: ExpertLoadCounter | None = None,
):
    """``prepare_model(model)``: called between construction and loading (a rank of an
    expert-parallel group keeps its expert slots there); it may return a filter for the weight
    stream. ``weight_format``: a usable format (``choose_weight_format``) holds the weights it
    claims its own way (packed), computes in its ``compute_dtype`` over its KV cache dtype and
    may replace each layer's attention backend; None: dense weights in ``dtype``.
    ``expert_load``: the counter the MoE layers feed (``ModelContext.expert_load``)."""
    archs = files.config.get("architectures") or []
    models = host.models()
    arch = next((a for a in archs if a in models), None)
    if arch is None:
        raise ValueError(
            f"{files.source}: architecture {archs or '(none given)'} is not supported; installed: "
            f"{', '.join(sorted(models))}"
        )
    ctx = model_context(host, platform, device, dtype, attention_backend, moe_backend, weight_format, parallel)
    ctx = ctx if expert_load is None else replace(ctx, expert_load=expert_load)

    def keep_packed(m) -> set[str]:  # the FP8 / MXFP4 modules the platform runs, swapped in
        return keep_fp8(m, files, host, platform) | keep_mxfp4(m, files, host, platform)

    swapped: list[set[str]] = []  # the checkpoint names kept packed, once the modules are swapped
    if weight_format is None and files.fp8_weights is not None:  # before allocation: no dense stand-ins
        ctx = replace(ctx, swap_modules=lambda meta_model: swapped.append(keep_packed(meta_model)))
    with torch.device(device), skip_random_init():  # every parameter comes from the checkpoint
        model = models[arch](files.config, ctx)
    stream = (prepare_model(model) if prepare_model is not None else None) or (lambda weights: weights)
    if weight_format is not None and weight_format.prepare(model):
        model.load_weights(stream(weight_format.weights(files)))
    elif files.fp8_weights is not None and (  # swapped at allocation, else now (a model without the hook)
        kept := swapped[0] if swapped else keep_packed(model)
    ):
        model.load_weights(stream(files.fp8_weights(frozenset(kept))))
    else:
        model.load_weights(stream(files.weights()))
    model = model.to(ctx.dtype).eval()
    if hasattr(model, "restore_float32"):  # parameters the model keeps in float32 whatever the dtype
        model.restore_float32()
    return model, ctx


def model_context(
    host: PluginHost,
    platform: Platform,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str | None = None,
    moe_backend: str | None = None,
    weight_format: WeightFormat | None = None,
    parallel=None,
) -> ModelContext:
    """What a model is built with: the hooks' attention and MoE objects, and for a weight format
        its compute dtype, its KV cache dtype and its say on each layer's attention backend (the
        low-bit format: one-token rows read its float16 / int8 cache in C). ``deepinfer plan`` builds
        its meta-device model with the same context. ``parallel``: the rank's ParallelConfig (the
    dispatcher hook's third argument; None: one rank)."""
    ctx = ModelContext(
        device=device,
        dtype=dtype,
        attention_backend=lambda spec: host.attention_backend(spec, platform, name=attention_backend),
        moe_dispatcher=lambda spec: host.moe_dispatcher(spec, platform, parallel, name=moe_backend),
    )
    if weight_format is None:
        return ctx
    chosen = ctx.attention_backend
    return replace(
        ctx,
        dtype=weight_format.compute_dtype or dtype,
        kv_dtype=weight_format.kv_cache_dtype(),
        attention_backend=lambda spec: weight_format.attention_backend(spec, chosen(spec)),
    )


def keep_fp8(model, files: ModelFiles, host: PluginHost, platform: Platform) -> set[str]:
    """Hold an FP8 block checkpoint's weights as FP8 where the platform has a kernel for them
    (``FusedOps.fp8_linear``); returns the checkpoint names kept (empty: dequantize at load)."""
    from ..models.fp8 import swap_in_fp8

    ops = host.fused_ops(platform)
    if ops is None or getattr(ops, "fp8_linear", None) is None:
        return set()
    return swap_in_fp8(model, files.fp8_names)


def keep_mxfp4(model, files: ModelFiles, host: PluginHost, platform: Platform) -> set[str]:
    """Hold a DeepSeek-V4 checkpoint's MXFP4 routed experts packed where the platform runs MoE
    on them (``FusedOps.mxfp4_moe``); returns the checkpoint names kept (empty: dequantize at
    load, as without the capability)."""
    if not files.mxfp4_names:
        return set()
    from ..models.mxfp4 import swap_in_mxfp4

    ops = host.fused_ops(platform)
    if ops is None or getattr(ops, "mxfp4_moe", None) is None:
        return set()
    return swap_in_mxfp4(model, files.mxfp4_names)


def weights_request(
    files: ModelFiles, dtype: str | torch.dtype, kv_cache_dtype: str = "auto", requested: str | None = None
) -> WeightsRequest:
    """What ``deepinfer_weight_format`` is asked about: the checkpoint's block-quantized tensors,
    the dtype as the user gave it (``auto`` lets a weight format choose) and the format asked for."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return WeightsRequest(files.source, files.quantized_names, files.quantized_types, name, kv_cache_dtype, requested)


def choose_weight_format(
    files: ModelFiles,
    host: PluginHost,
    platform: Platform,
    dtype: str | torch.dtype,
    kv_cache_dtype: str = "auto",
    name: str | None = None,
    warn: bool = False,
) -> tuple[WeightFormat | None, str]:
    """(the usable weight format for ``files``, or None: dense; why the weights are held as
    they are, for the start-up line). The engine (through :func:`load`) and ``deepinfer plan``
    both decide here, so the plan's KV dtype is the engine's. ``name``: ``LLM(weight_format=)``;
    ``warn``: log a format that claims the weights but cannot run here."""
    fmt = host.weight_format(weights_request(files, dtype, kv_cache_dtype, name), platform, name=name)
    if fmt is not None and fmt.unavailable is None:
        return fmt, fmt.description
    if fmt is not None:
        if warn:
            log.warning("%s: serving dequantized weights (%s)", files.source, fmt.unavailable)
        return None, f"dense weights: {fmt.unavailable}"
    if not files.quantized_names:
        return None, "dense checkpoint"
    if not isinstance(dtype, str) or dtype not in ("auto", "lowbit"):
        return None, "dense weights: a float dtype was asked for"
    types = ", ".join(sorted(files.quantized_types))
    return None, f"dense weights: no weight format for its block-quantized tensors ({types}) on {platform.name}"


def check_kv_cache_dtype(requested: str, dtype: torch.dtype, why_not: str | None) -> None:
    """Refuse a ``kv_cache_dtype`` the path cannot honour: a weight format that chooses its KV
    cache (``why_not`` None; the low-bit CPU path takes float16 / float32 / int8) checks it
    itself; dense weights cache keys and values in their compute dtype."""
    if why_not is None or requested in ("auto", str(dtype).removeprefix("torch.")):
        return
    name = str(dtype).removeprefix("torch.")
    raise ValueError(
        f"kv_cache_dtype={requested!r} is for packed low-bit weights on CPU (a block-quantized GGUF with dtype auto); "
        f"this engine's weights are dense ({why_not}) and cache keys and values in {name}: use 'auto' or {name!r}"
    )


def load(
    name: str,
    host: PluginHost,
    platform: Platform,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str | None = None,
    moe_backend: str | None = None,
    requested_dtype: str | torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
    weight_format: str | None = None,
    parallel=None,
    prepare_model=None,
    expert_load: ExpertLoadCounter | None = None,
):
    """``attention_backend`` / ``moe_backend`` / ``weight_format``: a plugin name or
    ``"builtin"`` picks that provider's implementation; None takes the host's default order.
    ``requested_dtype``: the dtype as the user gave it (``auto`` lets a weight format hold a
    checkpoint's weights its own way, e.g. a block-quantized GGUF packed on CPU; default:
    ``dtype``, which pins dense weights). ``kv_cache_dtype``: :class:`~deepinfer_core.engine.config.EngineConfig`'s.
    Returns ``(files, model, ctx, weight format or None, why the weights are held so)``."""
    host.check_backend_name("attention", attention_backend)  # before any file is read
    host.check_backend_name("moe", moe_backend)
    host.check_backend_name("weight format", weight_format)
    path = resolve_model_path(name, host)
    files = open_model_files(path)
    requested = dtype if requested_dtype is None else requested_dtype
    fmt, choice = choose_weight_format(files, host, platform, requested, kv_cache_dtype, weight_format, warn=True)
    if fmt is not None:
        dtype = fmt.compute_dtype or dtype
    chooses_cache = fmt is not None and fmt.kv_cache_dtype() is not None  # else the compute dtype's rule
    check_kv_cache_dtype(kv_cache_dtype, dtype, None if chooses_cache else choice)
    model, ctx = build_model(
        files,
        host,
        platform,
        device,
        dtype,
        attention_backend,
        moe_backend,
        fmt,
        parallel=parallel,
        prepare_model=prepare_model,
        expert_load=expert_load,
    )
    return files, model, ctx, fmt, choice
