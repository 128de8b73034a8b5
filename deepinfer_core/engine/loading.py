"""Resolve a model name to files, build the architecture through the plugin host, load weights."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from ..lowbit import native
from ..lowbit.attention import kv_dtype as lowbit_kv_dtype
from ..lowbit.attention import paged_decode
from ..builtin.lowbit.llama_decode import prefill_enabled
from ..lowbit.modules import swap_in_lowbit
from ..lowbit.threads import adaptive_enabled
from ..models import ModelContext
from ..models.fast_init import skip_random_init
from ..models.loaders.files import ModelFiles
from ..models.loaders.formats import open_model_files
from ..platform import Platform
from ..plugin_host import PluginHost

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
    lowbit: bool = False,
    kv_cache_dtype: str = "auto",
):
    """``lowbit``: keep block-quantized weights packed (``files.quantized_weights``); activations
    then stay float32, which the kernels read and write, over a cache of ``kv_cache_dtype``
    (:func:`deepinfer_core.lowbit.attention.kv_dtype`)."""
    archs = files.config.get("architectures") or []
    models = host.models()
    arch = next((a for a in archs if a in models), None)
    if arch is None:
        raise ValueError(
            f"{files.source}: architecture {archs or '(none given)'} is not supported; installed: {', '.join(sorted(models))}"
        )
    ctx = ModelContext(
        device=device,
        dtype=dtype,
        attention_backend=lambda spec: host.attention_backend(spec, platform, name=attention_backend),
        moe_dispatcher=lambda spec: host.moe_dispatcher(spec, platform, name=moe_backend),
    )
    if lowbit:  # float32 activations over a float16 KV cache (8-bit files: float32; kv_cache_dtype may say int8); attention rows read it in C
        resolve = ctx.attention_backend
        ctx = replace(
            ctx,
            dtype=torch.float32,
            kv_dtype=lowbit_kv_dtype(files.quantized_types, kv_cache_dtype),
            attention_backend=lambda spec: paged_decode(resolve(spec), native.load().lib),
        )
        adaptive_enabled()  # a bad DEEPINFER_ADAPTIVE_THREADS is refused here, not at the first decode step
        prefill_enabled()  # and a bad DEEPINFER_NATIVE_PREFILL
    with torch.device(device), skip_random_init():  # every parameter comes from the checkpoint
        model = models[arch](files.config, ctx)
    if lowbit and swap_in_lowbit(model, set(files.quantized_names)):
        model.load_weights(files.quantized_weights())
    elif files.fp8_weights is not None and (kept := keep_fp8(model, files, host, platform)):
        model.load_weights(files.fp8_weights(frozenset(kept)))
    else:
        model.load_weights(files.weights())
    model = model.to(ctx.dtype).eval()
    if hasattr(model, "restore_float32"):  # parameters the model keeps in float32 whatever the dtype
        model.restore_float32()
    return model, ctx


def keep_fp8(model, files: ModelFiles, host: PluginHost, platform: Platform) -> set[str]:
    """Hold an FP8 block checkpoint's weights as FP8 where the platform has a kernel for them
    (``FusedOps.fp8_linear``); returns the checkpoint names kept (empty: dequantize at load)."""
    from ..models.fp8 import swap_in_fp8

    ops = host.fused_ops(platform)
    if ops is None or getattr(ops, "fp8_linear", None) is None:
        return set()
    return swap_in_fp8(model, files.fp8_names)


def lowbit_unavailable(files: ModelFiles, device: torch.device) -> str | None:
    """Why ``files`` cannot be served with packed low-bit weights here (None: it can)."""
    if device.type != "cpu":
        return f"low-bit kernels are CPU kernels (device {device})"
    if files.quantized_weights is None:
        return "not a block-quantized checkpoint"
    return native.load().reason or None


def weights_choice(files: ModelFiles, device: torch.device, allow_lowbit: bool) -> str:
    """Why the weights are packed or dense, for the start-up line (``dtype`` as the user gave it
    decides ``allow_lowbit``: ``auto``/``lowbit`` on CPU allow it, a float dtype pins dense)."""
    if not allow_lowbit:
        return (
            "dense weights: a float dtype was asked for" if files.quantized_weights is not None else "dense checkpoint"
        )
    why_not = lowbit_unavailable(files, device)
    if why_not:
        return f"dense weights: {why_not}"
    return f"block-quantized GGUF on CPU: weights kept packed (dtype=float32 for the dequantized reference), kernels {native.describe_isa(native.load().isa)}"


def resolve_dtype(
    files: ModelFiles, device: torch.device, dtype: torch.dtype, allow_lowbit: bool
) -> tuple[torch.dtype, str | None]:
    """(the dtype the model computes and caches KV in, why its weights are not kept packed or
    None when they are). Packed low-bit weights run float32 activations whatever ``dtype`` says.
    The engine (through :func:`load`) and ``deepinfer plan`` both decide here, so the plan's KV
    dtype is the engine's."""
    why_not = lowbit_unavailable(files, device) if allow_lowbit else "not requested"
    return (torch.float32 if why_not is None else dtype), why_not


def check_kv_cache_dtype(requested: str, dtype: torch.dtype, why_not: str | None) -> None:
    """Refuse a ``kv_cache_dtype`` the path cannot honour: the low-bit CPU path (``why_not`` None)
    takes float16 / float32 / int8; any other path caches keys and values in its compute dtype."""
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
    allow_lowbit: bool = False,
    kv_cache_dtype: str = "auto",
):
    """``attention_backend`` / ``moe_backend``: a plugin name or ``"builtin"`` picks that
    provider's implementation for every layer; None takes the host's default order.
    ``allow_lowbit``: serve a block-quantized GGUF's weights packed where the kernels run.
    ``kv_cache_dtype``: :class:`~deepinfer_core.engine.config.EngineConfig`'s."""
    host.check_backend_name("attention", attention_backend)  # before any file is read
    host.check_backend_name("moe", moe_backend)
    path = resolve_model_path(name, host)
    files = open_model_files(path)
    dtype, why_not = resolve_dtype(files, device, dtype, allow_lowbit)
    check_kv_cache_dtype(kv_cache_dtype, dtype, why_not)
    if allow_lowbit and why_not and files.quantized_weights is not None:
        log.warning("%s: serving dequantized %s weights (%s)", path, dtype, why_not)
    model, ctx = build_model(
        files,
        host,
        platform,
        device,
        dtype,
        attention_backend,
        moe_backend,
        lowbit=why_not is None,
        kv_cache_dtype=kv_cache_dtype,
    )
    return files, model, ctx
