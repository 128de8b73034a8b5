"""KV-cache capacity of a model from its config alone, before any weights
are downloaded or cards bought.

    deepinfer plan --model M --kv-cache-gib N [--max-model-len L] [--dtype auto] [--max-num-seqs S]

(the command: ``deepinfer_core/entrypoints/plan.py``)

The model is built on the meta device (its config only; no weights read, no memory taken) and
sized by :func:`deepinfer_core.engine.kv_sizing.kv_sizing`, the function the engine allocates
from, so the numbers here are the engine's: an engine given ``kv_cache_gib=N`` allocates exactly
``blocks`` blocks and ``total_bytes`` bytes. Reported: block KV bytes per token for each layer kind,
state KV per request (DeepSeek-V4), the blocks and tokens of context that fit next to the state
KV of ``max_num_seqs + 1`` slots, and how many requests of ``L`` tokens fit at once (with
``--max-num-seqs`` set to that number).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class KindRow:
    kind: str
    layers: int
    bytes_per_token: float  # block KV, all layers of this kind


@dataclass(frozen=True)
class Plan:
    model: str
    architecture: str
    dtype: str
    block_size: int
    kinds: tuple[KindRow, ...]
    bytes_per_token: float  # block KV, all layers
    block_bytes: int
    state_bytes_per_request: int
    max_num_seqs: int
    state_slots: int
    kv_budget_bytes: int
    blocks: int  # with max_num_seqs as given
    context_tokens: int
    total_bytes: int  # what the engine allocates: blocks + state
    max_model_len: int
    blocks_per_request: int
    concurrent_requests: int  # requests of max_model_len tokens that fit at once


def read_config(model: str) -> tuple[dict, str, object]:
    """The model's config dict, where it came from, and its opened model files (None for a
    directory's config.json: weights not needed), else whatever the model files say (GGUF
    metadata, aliases)."""
    from .engine.loading import resolve_model_path
    from .plugin_host import default_host

    path = resolve_model_path(model, default_host())
    config_json = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(config_json):
        with open(config_json) as f:
            return json.load(f), path, None
    from .models.loaders.formats import open_model_files

    files = open_model_files(path)
    return files.config, path, files


def plan(
    model: str,
    kv_gib: float,
    *,
    max_model_len: int | None = None,
    dtype: str = "auto",
    block_size: int = 128,
    max_num_seqs: int = 64,
    device: str = "auto",
    host=None,
    kv_cache_dtype: str = "auto",
    weight_format: str | None = None,
) -> Plan:
    """Capacity of ``kv_gib`` GiB of KV cache for ``model``; ``device`` picks whose attention
    backends' cache shapes count (the platform the deployment will run on); ``weight_format``
    as the engine's option (a weight format may choose the compute and KV cache dtypes)."""
    import torch

    from .engine.config import EngineConfig
    from .engine.kv_sizing import kv_sizing
    from .plugin_host import default_host

    if kv_gib <= 0:
        raise ValueError(f"--kv-gib must be > 0, got {kv_gib}")
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {max_model_len}")
    host = host or default_host()
    engine = EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
    )
    platform = host.platform(device)
    kv_dtype = engine.torch_dtype(platform.device_type)
    config, source, files = read_config(model)
    fmt = None  # a weight format (e.g. a block-quantized GGUF packed on CPU) decides the compute and cache dtypes
    why_not = "not a GGUF"
    if files is not None:  # the engine's rule (engine.loading.choose_weight_format)
        from .engine.loading import choose_weight_format

        fmt, why_not = choose_weight_format(files, host, platform, dtype, kv_cache_dtype, weight_format)
        if fmt is not None:
            kv_dtype = fmt.compute_dtype or kv_dtype
            why_not = None if fmt.kv_cache_dtype() is not None else why_not
    from .engine.loading import check_kv_cache_dtype, model_context

    check_kv_cache_dtype(kv_cache_dtype, kv_dtype, why_not)
    archs = config.get("architectures") or []
    models = host.models()
    arch = next((a for a in archs if a in models), None)
    if arch is None:
        raise ValueError(
            f"{source}: architecture {archs or '(none given)'} is not supported; installed: {', '.join(sorted(models))}"
        )
    meta = torch.device("meta")
    # the weight format's say on each layer's backend counts: its cache shape (an int8 row carries its scale)
    ctx = model_context(host, platform, meta, kv_dtype, weight_format=fmt)
    with meta:
        built = models[arch](config, ctx)
    sizing = kv_sizing(built, ctx.attention_backend, block_size, max_num_seqs)
    budget = kv_gib * GIB
    blocks = sizing.blocks_for_budget(budget)
    length = min(max_model_len or built.max_position_embeddings, built.max_position_embeddings)
    per_request = -(-length // block_size)
    # With max_num_seqs = n the engine reserves n + 1 state slots (0 bytes each for paged-only
    # models) and needs n * per_request blocks.
    state = sizing.state_bytes_per_request
    fit = int((budget - (state if sizing.num_state_slots else 0)) // (per_request * sizing.block_bytes + state))
    return Plan(
        model=source, architecture=arch, block_size=block_size,
        dtype=str(ctx.kv_dtype or kv_dtype).removeprefix("torch."),
        kinds=tuple(KindRow(k, n, b / block_size) for k, n, b in sizing.block_bytes_by_kind),
        bytes_per_token=sizing.block_bytes / block_size, block_bytes=sizing.block_bytes,
        state_bytes_per_request=state, max_num_seqs=max_num_seqs, state_slots=sizing.num_state_slots,
        kv_budget_bytes=int(budget), blocks=blocks, context_tokens=blocks * block_size,
        total_bytes=sizing.total_bytes(blocks), max_model_len=length, blocks_per_request=per_request,
        concurrent_requests=max(0, fit),
    )  # fmt: skip


def format_plan(p: Plan) -> str:
    mib = lambda n: f"{n / 2**20:,.2f} MiB"  # noqa: E731
    lines = [
        f"model       {p.model} ({p.architecture})",
        f"KV dtype    {p.dtype}, blocks of {p.block_size} tokens ({mib(p.block_bytes)} of block KV each)",
        "",
        f"{'LAYER KIND':<32}{'LAYERS':>7}{'BLOCK KV BYTES/TOKEN':>24}",
    ]
    lines += [f"{r.kind:<32}{r.layers:>7}{r.bytes_per_token:>24,.1f}" for r in p.kinds]
    lines += [f"{'all layers':<32}{sum(r.layers for r in p.kinds):>7}{p.bytes_per_token:>24,.1f}", ""]
    if p.state_bytes_per_request:
        lines.append(
            f"state KV    {mib(p.state_bytes_per_request)} per running request "
            f"({p.state_slots} slots with max_num_seqs={p.max_num_seqs}: "
            f"{mib(p.state_slots * p.state_bytes_per_request)})"
        )
    lines += [
        f"budget      {p.kv_budget_bytes / GIB:g} GiB -> {p.blocks:,} blocks = {p.context_tokens:,} tokens of "
        f"context (allocated {mib(p.total_bytes)})",
        f"requests    of {p.max_model_len:,} tokens ({p.blocks_per_request:,} blocks each): "
        f"{p.concurrent_requests:,} fit at once (--max-num-seqs {p.concurrent_requests})",
    ]
    return "\n".join(lines)
