"""Engine configuration (explicit, frozen)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_dtype_names import KV_CACHE_DTYPES

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "auto"
    # auto: a weight format may hold the checkpoint's weights its own way (deepinfer_weight_format:
    # on CPU the builtin core.lowbit keeps a block-quantized GGUF packed, float32 activations; the
    # fastest CPU path, benchmarks/README.md) where its kernels run;
    # dense weights compute in bfloat16 where the CPU has bf16 dot products (AVX512-BF16/AMX),
    # else float32; bfloat16 off the CPU. lowbit: the same as auto (kept as an explicit name).
    # Any other dtype loads dense weights (float32: the exact reference the tests pin).
    dtype: str = "auto"
    # the KV cache's element type: auto (the low-bit CPU path: float16, float32 for an all-8-bit
    # file; elsewhere the compute dtype); float16 / float32 / int8 choose it on the low-bit path
    # (int8: a float32 scale per token and KV head, opt-in, benchmarks/README.md kv8); elsewhere only
    # the compute dtype's own name is accepted
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_blocks: int | None = None  # None: sized from kv_cache_gib, else from free memory
    kv_cache_gib: float | None = None  # KV budget (block KV + state KV), as `deepinfer plan` sizes it
    block_size: int = 128
    max_model_len: int | None = None  # None: the model's context length
    batch_invariant: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0  # draws the per-request seeds of requests that bring none
    attention_backend: str | None = None  # a plugin name or "builtin"; None: the default order
    moe_backend: str | None = None  # likewise for the MoE dispatcher
    weight_format: str | None = (
        None  # likewise for the weight format (deepinfer_weight_format); None: the default order
    )
    enforce_eager: bool = False  # never replay captured decode graphs (deepinfer_decode_graphs)
    kv_store: str | None = None  # persistent KV cache URL (local:///path, 3fs:///mount, memory://); None: off
    kv_store_gib: float | None = None  # the store's capacity (LRU eviction past it); None: unbounded
    kv_host_pool_gib: float = 1.0  # host memory between the device cache and the store
    # build step N+1 while the device runs step N (engine/overlap.py); None: on off the CPU
    overlap_scheduling: bool | None = None
    overlap_debug: bool = False  # check every device-fed token against the committed history
    fused_ops: bool = True  # a platform's fused RMSNorm / SiLU-and-mul kernels (deepinfer_fused_ops)

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
        if (
            self.dtype not in ("auto", "lowbit")
            and self.dtype not in _DTYPES
            and not isinstance(self.dtype, torch.dtype)
        ):
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of auto, lowbit, {', '.join(_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")

    def torch_dtype(self, device_type: str) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype in ("auto", "lowbit"):
            if device_type == "cpu":
                from ..builtin.cpu_features import cpu_features

                return cpu_features().auto_dtype
            return torch.bfloat16
        return _DTYPES[self.dtype]
