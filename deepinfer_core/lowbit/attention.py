"""Decode attention for the CPU low-bit path, read in place from the paged KV cache.

The torch reference backend answers a decode step by gathering every request's whole context
into a fresh ``[Hkv, R, S, D]`` copy per layer (one ``index_select``), then about ten ops on it.
At 32 requests that copy moved more bytes than the attention arithmetic read, and at one
request the ops cost more host time than the arithmetic. :class:`PagedDecodeAttention` keeps
the reference for prefill, mixed and batch-invariant steps and sends one-token rows to
``paged_decode_attention`` in ``attention.c`` (the one-call decode step in ``layer.c`` calls the
same function): one call per layer, keys and values read where they lie, each request computed
alone (float32 scores, softmax and sum). The low-bit path's cache is float16 (:func:`kv_dtype`).

An int8 cache (opt-in: ``kv_cache_dtype="int8"``) holds each (token, KV head) row as head_dim int8
codes followed by the row's float32 scale max|x| / 127, in one int8 tensor of row width
``max(head_dim, v_head_dim) + 4`` (:meth:`PagedDecodeAttention.kv_cache_shape`): a block holds its
codes and scales together, so a block copied whole (the KV-store tiers) carries its scales, and
attention.c reads a row's scale from the bytes after its codes. Rows are quantized as they are
written (C, every step), decode and native prefill attention read the codes in C; the torch
paths this backend hands steps to (batch-invariant, replays, models without the native step)
read the step's blocks dequantized to float32 (:func:`dequantize_blocks`).
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import torch

from .. import envs
from ..attention import AttentionLayerSpec, AttentionMetadata
from ..attention.torch_ref import TorchAttentionBackend

CACHE_DTYPES = (torch.float32, torch.float16, torch.int8)  # what attention.c reads
KV_ENV = "DEEPINFER_LOWBIT_KV_DTYPE"
# the user-facing kv_cache_dtype values but "auto" (engine/kv_dtype_names.py; tests/test_lowbit_kv8.py keeps them equal)
_KV_NAMES = {"float16": torch.float16, "float32": torch.float32, "int8": torch.int8}
KV_CACHE_DTYPES = ("auto", *_KV_NAMES)
SCALE_BYTES = 4  # an int8 row's float32 scale, after its codes


def kv_kind(dtype: torch.dtype) -> int:
    """vec.h's KV_F32 / KV_F16 / KV_I8 code of a cache dtype."""
    return {torch.float32: 0, torch.float16: 1, torch.int8: 2}[dtype]


EIGHT_BIT_TYPES = frozenset({"Q8_0", "Q8_1", "Q8_K"})


def kv_dtype(weight_types: frozenset = frozenset(), requested: str = "auto") -> torch.dtype:
    """The KV cache dtype of the low-bit path for packed weights of GGML types ``weight_types``:
    ``requested`` (the engine's ``kv_cache_dtype``: float16 / float32 / int8) when it is not
    ``auto``; else ``DEEPINFER_LOWBIT_KV_DTYPE`` (float16 / float32 / int8) when set; else float16,
    or float32 when every packed weight is 8-bit. int8 is opt-in: it halves the float16 cache's
    bytes but changes the numbers (benchmarks/README.md, kv8).

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
    if requested != "auto":
        if requested not in _KV_NAMES:
            raise ValueError(f"kv_cache_dtype={requested!r}: allowed values are {', '.join(KV_CACHE_DTYPES)}")
        return _KV_NAMES[requested]
    default = "float32" if weight_types and weight_types <= EIGHT_BIT_TYPES else "float16"
    return _KV_NAMES[envs.get(KV_ENV) or default]


class PagedDecodeAttention(TorchAttentionBackend):
    name = "torch-reference+paged-decode"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def kv_cache_shape(self, spec: AttentionLayerSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        shape = super().kv_cache_shape(spec, num_blocks, block_size)
        if spec.kv_dtype != torch.int8:
            return shape
        if spec.kv_shared:
            raise ValueError(
                "kv_cache_dtype='int8' needs separate key and value planes; this model shares them "
                "(use float16 or float32)"
            )
        return (*shape[:-1], shape[-1] + SCALE_BYTES)  # each row: codes, then its float32 scale

    def forward(self, spec, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if kv_cache.dtype == torch.int8:
            return self._forward_int8(spec, q, k, v, kv_cache, meta)
        one_token_rows = meta.max_query_len == 1 and q.shape[0] == meta.num_requests and not meta.replay
        if (
            meta.batch_invariant
            or not one_token_rows
            or not _plain(spec, q, kv_cache)
            or k.dtype != q.dtype
            or v.dtype != q.dtype
        ):
            return super().forward(spec, q, k, v, kv_cache, meta)
        k, v = k.contiguous(), v.contiguous()  # [R, Hkv, D]
        slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.long()
        _, heads, blocks, bs, width = kv_cache.shape
        self._lib.paged_write_kv(
            k.data_ptr(),
            v.data_ptr(),
            kv_cache.data_ptr(),
            heads,
            blocks,
            bs,
            width,
            spec.head_dim,
            spec.v_head_dim,
            slots.contiguous().data_ptr(),
            k.shape[0],
            kv_kind(kv_cache.dtype),
        )
        return self._forward_decode(spec, q, kv_cache, meta)

    def _forward_int8(self, spec, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Quantize the new rows into the cache (C, any step), then the C decode kernel for
        one-token rows, or the torch reference over the step's blocks dequantized."""
        if spec.kv_shared or not kv_cache.is_contiguous():
            raise ValueError("the int8 KV cache needs separate key and value planes in one contiguous tensor")
        if not meta.replay:
            k, v = k.float().contiguous(), v.float().contiguous()  # [T, Hkv, D]
            slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.long()
            _, heads, blocks, bs, width = kv_cache.shape
            self._lib.paged_write_kv(
                k.data_ptr(),
                v.data_ptr(),
                kv_cache.data_ptr(),
                heads,
                blocks,
                bs,
                width,
                spec.head_dim,
                spec.v_head_dim,
                slots.contiguous().data_ptr(),
                k.shape[0],
                kv_kind(torch.int8),
            )
        one_token_rows = meta.max_query_len == 1 and q.shape[0] == meta.num_requests and not meta.replay
        if one_token_rows and not meta.batch_invariant and q.dtype == torch.float32:
            return self._forward_decode(spec, q, kv_cache, meta)
        tables = meta.block_tables.long().clamp(min=0)
        used = torch.unique(tables)
        dense = dequantize_blocks(kv_cache.index_select(2, used), spec.head_dim, spec.v_head_dim)
        remap = torch.zeros(kv_cache.shape[2], dtype=torch.int32)
        remap[used] = torch.arange(used.shape[0], dtype=torch.int32)
        local = replace(meta, block_tables=remap[tables], scratch=None)
        if meta.batch_invariant:
            return self._forward_per_request(spec, q, dense, local)
        if meta.max_query_len == 1 and q.shape[0] == meta.num_requests:
            return super()._forward_decode(spec, q, dense, local)
        return self._forward_padded(spec, q, dense, local)

    def _forward_decode(
        self, spec: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
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
            out.data_ptr(), torch.get_num_threads(), kv_kind(kv_cache.dtype),
        )  # fmt: skip
        return out


def dequantize_blocks(cache: torch.Tensor, head_dim: int, v_head_dim: int) -> torch.Tensor:
    """An int8 cache (or some of its blocks) ``[2, Hkv, blocks, bs, W + 4]`` as float32
    ``[2, Hkv, blocks, bs, W]``: each row's codes times the float32 scale stored after them."""
    width = cache.shape[-1] - SCALE_BYTES
    out = torch.zeros(*cache.shape[:-1], width)
    for plane, n in ((0, head_dim), (1, v_head_dim)):
        rows = cache[plane]
        scale = rows[..., n : n + SCALE_BYTES].contiguous().view(torch.float32)  # [Hkv, blocks, bs, 1]
        out[plane, ..., :n] = rows[..., :n].float() * scale
    return out


def _plain(spec: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The layout the C path reads: separate K/V planes, float32 queries, a contiguous float32,
    float16 or int8 cache."""
    return (
        not spec.kv_shared and q.dtype == torch.float32 and kv_cache.dtype in CACHE_DTYPES and kv_cache.is_contiguous()
    )


def paged_decode(backend, lib: ctypes.CDLL):
    """``backend``, or its paged-decode form when it is the plain torch reference (a backend a
    plugin provides, or one asked for by name, is kept as it is)."""
    return PagedDecodeAttention(lib) if type(backend) is TorchAttentionBackend else backend
