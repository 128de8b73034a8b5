"""Decode attention for the CPU low-bit path, read in place from the paged KV cache.

The torch reference backend answers a decode step by gathering every request's whole context
into a fresh ``[Hkv, R, S, D]`` copy per layer (one ``index_select``), then about ten ops on it.
At 32 requests that copy moved more bytes than the attention arithmetic read, and at one
request the ops cost more host time than the arithmetic. :class:`PagedDecodeAttention` keeps
the reference for prefill, mixed and batch-invariant steps and sends one-token rows to
``paged_decode_attention`` in ``attention.c`` (the one-call decode step in ``layer.c`` calls the
same function): one call per layer, keys and values read where they lie, each request computed
alone (float32 scores, softmax and sum). The low-bit path's cache is float16 (:func:`kv_dtype`).
"""
from __future__ import annotations

import ctypes
import os

import torch

from ..attention import AttentionLayerSpec, AttentionMetadata
from ..attention.torch_ref import TorchAttentionBackend

CACHE_DTYPES = (torch.float32, torch.float16)  # what attention.c reads
KV_ENV = "DEEPINFER_LOWBIT_KV_DTYPE"
_KV_NAMES = {"float16": torch.float16, "float32": torch.float32}


EIGHT_BIT_TYPES = frozenset({"Q8_0", "Q8_1", "Q8_K"})


def kv_dtype(weight_types: frozenset = frozenset()) -> torch.dtype:
    """The KV cache dtype of the low-bit path for packed weights of GGML types ``weight_types``:
    float16, or float32 when every packed weight is 8-bit; ``DEEPINFER_LOWBIT_KV_DTYPE``
    (float16 / float32) overrides either.

    Why half: at 32 requests the decode step's attention read the whole float32 cache each
    layer (~250 MB a step), bounded by memory bandwidth; half elements halve those reads (and
    the prefill's gathers). llama.cpp's default cache is f16 too. Activations and attention
    arithmetic stay float32; a key or value is rounded once, when it is written (~5e-4 relative).
    Why not for 8-bit files: whoever picks Q8_0 over a 4-bit file picks fidelity, and there the
    half cache was the largest difference from the float32 model left (SmolLM2 Q8_0, 16 chat
    prompts, 64 greedy tokens identical to the dequantized float32 model: 14/16 with a float16
    cache, 16/16 with float32, the same int16-activation kernels; benchmarks/README.md), for
    ~5% of a 32-request decode step. ``float32`` keeps the cache exact (the dequantized
    reference's, to compare logits closely)."""
    default = "float32" if weight_types and weight_types <= EIGHT_BIT_TYPES else "float16"
    name = os.environ.get(KV_ENV, default)
    if name not in _KV_NAMES:
        raise ValueError(f"{KV_ENV}={name!r}: allowed values are {', '.join(_KV_NAMES)}")
    return _KV_NAMES[name]


class PagedDecodeAttention(TorchAttentionBackend):
    name = "torch-reference+paged-decode"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def forward(self, spec, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        one_token_rows = meta.max_query_len == 1 and q.shape[0] == meta.num_requests and not meta.replay
        if meta.batch_invariant or not one_token_rows or not _plain(spec, q, kv_cache) or k.dtype != q.dtype or v.dtype != q.dtype:
            return super().forward(spec, q, k, v, kv_cache, meta)
        k, v = k.contiguous(), v.contiguous()  # [R, Hkv, D]
        slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.long()
        _, heads, blocks, bs, width = kv_cache.shape
        self._lib.paged_write_kv(k.data_ptr(), v.data_ptr(), kv_cache.data_ptr(), heads, blocks, bs, width, spec.head_dim,
                                 spec.v_head_dim, slots.contiguous().data_ptr(), k.shape[0], kv_cache.dtype == torch.float16)
        return self._forward_decode(spec, q, kv_cache, meta)

    def _forward_decode(self, spec: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not _plain(spec, q, kv_cache):
            return super()._forward_decode(spec, q, kv_cache, meta)
        R = meta.num_requests
        q = q.contiguous()  # [R, H, D]
        tables = meta.block_tables if meta.block_tables.dtype == torch.int32 else meta.block_tables.int()
        tables = tables.contiguous()  # [R, max_blocks]
        positions = meta.positions if meta.positions.dtype == torch.int64 else meta.positions.long()
        out = torch.empty(R, spec.num_heads, spec.v_head_dim)  # [R, H, Dv]
        _, heads, blocks, bs, width = kv_cache.shape
        self._lib.paged_decode_attention(
            q.data_ptr(), kv_cache.data_ptr(), heads, blocks, bs, width, spec.num_heads, spec.head_dim, spec.v_head_dim,
            tables.data_ptr(), tables.shape[1], positions.contiguous().data_ptr(), R, spec.scale, spec.window or 0,
            out.data_ptr(), torch.get_num_threads(), kv_cache.dtype == torch.float16,
        )  # fmt: skip
        return out


def _plain(spec: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The layout the C path reads: separate K/V planes, float32 queries, a contiguous float32 or
    float16 cache."""
    return not spec.kv_shared and q.dtype == torch.float32 and kv_cache.dtype in CACHE_DTYPES and kv_cache.is_contiguous()


def paged_decode(backend, lib: ctypes.CDLL):
    """``backend``, or its paged-decode form when it is the plain torch reference (a backend a
    plugin provides, or one asked for by name, is kept as it is)."""
    return PagedDecodeAttention(lib) if type(backend) is TorchAttentionBackend else backend
