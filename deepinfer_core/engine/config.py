"""Engine configuration (explicit, frozen).

Every field is defined once, here: its type, default, help text and allowed values (the
field's ``metadata``, made by :func:`option`). ``LLM(model, **options)`` takes exactly these
names, and every command that builds an engine (``deepinfer generate``, ``serve``, ``plan``)
generates its engine options from them (``deepinfer_core/entrypoints/engine_options.py``), so
they agree in name, default and help. This module imports no torch at import time: the
command line builds its parsers from it before anything heavy is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .kv_dtype_names import KV_CACHE_DTYPES
from .spec_config import parse_spec_config

if TYPE_CHECKING:
    import torch

# dtype names -> torch attribute names (torch is imported where a dtype is resolved)
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
DTYPE_NAMES = ("auto", "lowbit", *_DTYPES)


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    default_text: str | None = None,
    metavar: str | None = None,
) -> Any:
    """A field of :class:`EngineConfig` with what a user needs to know about it: ``help``
    (one sentence or two), ``choices`` (the accepted values where they are a closed set),
    ``default_text`` (how to describe a ``None`` default, e.g. "the model's context length")."""
    meta = {"help": help, "choices": choices, "default_text": default_text, "metavar": metavar}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = option("auto", "cpu, cuda, cuda:1, ... or auto (the first usable installed platform)")
    dtype: str = option(
        "auto",
        "auto: on CPU a block-quantized GGUF keeps its low-bit weights packed (float32 activations, the "
        "fastest CPU path), dense weights compute in bfloat16 where the CPU has bf16 dot products "
        "(AVX512-BF16/AMX), else float32; bfloat16 off the CPU. lowbit: the same as auto. float32 / "
        "bfloat16 / float16 load dense weights (float32 is the exact reference the tests pin)",
        choices=DTYPE_NAMES,
        metavar="DTYPE",
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's element type: auto (the low-bit CPU path: float16, float32 for an all-8-bit "
        "file; elsewhere the compute dtype); float16 / float32 / int8 choose it on the low-bit path "
        "(int8: a float32 scale per token and KV head, half float16's bytes, opt-in: changes the "
        "numbers); dense weights accept only auto or their compute dtype's own name",
        choices=KV_CACHE_DTYPES,
    )
    max_num_seqs: int = option(64, "requests decoded together at most")
    max_num_batched_tokens: int = option(2048, "tokens computed in one step at most (prefill chunks included)")
    kv_cache_blocks: int | None = option(
        None, "KV cache size in blocks", default_text="sized from --kv-cache-gib, else from free memory"
    )
    kv_cache_gib: float | None = option(
        None,
        "KV cache budget in GiB (block KV + state KV), as `deepinfer plan` sizes it",
        default_text="sized from free memory",
        metavar="GIB",
    )
    block_size: int = option(128, "tokens per KV cache block")
    max_model_len: int | None = option(None, "longest request in tokens", default_text="the model's context length")
    batch_invariant: bool = option(False, "the same tokens for a request whatever else runs in its batch")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes seen before")
    seed: int = option(0, "draws the per-request seeds of requests that bring none")
    attention_backend: str | None = option(
        None,
        "plugin whose attention kernels to use, or 'builtin'",
        default_text="installed plugins by name, then builtin",
        metavar="NAME",
    )
    moe_backend: str | None = option(
        None, "plugin whose MoE dispatcher to use, or 'builtin'", default_text="as for attention", metavar="NAME"
    )
    weight_format: str | None = option(
        None,
        "plugin whose weight format holds the checkpoint's weights (deepinfer_weight_format; the builtin "
        "core.lowbit keeps a block-quantized GGUF packed on CPU)",
        default_text="the first format that claims the weights and runs here, else dense",
        metavar="NAME",
    )
    enforce_eager: bool = option(False, "never replay captured decode graphs (deepinfer_decode_graphs)")
    kv_store: str | None = option(
        None,
        "persistent KV cache: memory://, local:///path, 3fs:///mount/path or a plugin's scheme",
        default_text="none, device prefix cache only",
        metavar="URL",
    )
    kv_store_gib: float | None = option(
        None,
        "capacity of the KV store; least recently used blocks are evicted past it",
        default_text="unbounded",
        metavar="GIB",
    )
    kv_host_pool_gib: float = option(1.0, "host memory between the device KV cache and the store, GiB", metavar="GIB")
    overlap_scheduling: bool | None = option(
        None,
        "build step N+1 while the device runs step N (engine/overlap.py)",
        default_text="on off the CPU",
    )
    overlap_debug: bool = option(
        False, "check every device-fed token against the committed history (also DEEPINFER_OVERLAP_DEBUG=1)"
    )
    fused_ops: bool = option(True, "a platform's fused RMSNorm / SiLU-and-mul kernels (deepinfer_fused_ops)")
    speculative_config: dict | str | None = option(
        None,
        'speculative decoding, as JSON: {"method": "ngram"|"mtp"|"draft", "num_speculative_tokens": 5, '
        '"verification": "fixed"|"confidence", "model": PATH (draft)}; docs/speculative.md',
        default_text="off",
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be >= 1, got {self.kv_cache_blocks}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if not self.kv_host_pool_gib > 0:
            raise ValueError(f"kv_host_pool_gib must be > 0, got {self.kv_host_pool_gib}")
        if self.dtype not in ("auto", "lowbit") and self.dtype not in _DTYPES and not _is_torch_dtype(self.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of auto, lowbit, {', '.join(_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
        # checked here (a clear ValueError at LLM(...) / the command line); kept as the SpecConfig
        object.__setattr__(self, "speculative_config", parse_spec_config(self.speculative_config))

    def torch_dtype(self, device_type: str) -> torch.dtype:
        import torch

        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype in ("auto", "lowbit"):
            if device_type == "cpu":
                from ..builtin.cpu_features import cpu_features

                return cpu_features().auto_dtype
            return torch.bfloat16
        return getattr(torch, _DTYPES[self.dtype])


def _is_torch_dtype(value: object) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


def engine_options() -> tuple[dataclasses.Field, ...]:
    """The fields a user sets (everything but ``model``), in definition order."""
    return tuple(f for f in dataclasses.fields(EngineConfig) if f.name != "model")


def engine_config(model: str, **options: Any) -> EngineConfig:
    """``EngineConfig(model, **options)``, with an unknown option refused by a TypeError that
    names it and the closest known names (``LLM(model, **options)`` goes through here)."""
    names = [f.name for f in engine_options()]
    for name in options:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else f"; the engine options are {', '.join(names)}"
            raise TypeError(f"unknown engine option {name!r}{hint}")
    return EngineConfig(model=model, **options)


def with_engine_options(function):
    """Give ``function(self, model, *, ..., **options)`` a signature that lists every engine
    option (name, type, default) in place of ``**options``, and a docstring paragraph with
    their help, so ``help(LLM)`` and editors show them; the names are still checked at the call
    by :func:`engine_config`."""
    import inspect

    signature = inspect.signature(function)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in engine_options()
    ]
    function.__signature__ = signature.replace(parameters=params)
    lines = [f"    {f.name} ({f.type}, default {f.default!r}): {f.metadata['help']}" for f in engine_options()]
    function.__doc__ = (function.__doc__ or "").rstrip() + "\n\nEngine options:\n\n" + "\n".join(lines) + "\n"
    return function
