"""Attention layer specs, batch metadata and the backend protocol.

The model describes each attention layer with a frozen :class:`AttentionLayerSpec`; the
``deepinfer_attention_backend`` hook turns it into an :class:`AttentionBackend`; the model
runner allocates each layer's KV cache from the backend's :meth:`kv_cache_shape` and calls
:meth:`AttentionBackend.forward` with a flat token batch and an :class:`AttentionMetadata`.

Flat token batch (requests r0, r1, r2 scheduled with 3, 1 and 2 new tokens)::

    tokens          t0 t1 t2 | t3 | t4 t5
    query_start_loc 0        3    4     6        [R+1] int32
    seq_lens        (computed before + new) per request  [R] int32
    positions       absolute position of each token       [T] int64
    slot_mapping    block_id * block_size + offset        [T] int64
    block_tables    [R, max_blocks] int32 (padded with 0)

Capabilities: a backend says which layer kinds it serves with a ``capabilities`` attribute
(:class:`AttentionCapabilities`); the host hands it only those (:func:`attention_capabilities`).
One that declares nothing is taken as written for the previous contract (contract 1): it serves
the layers its hook returns it for, and a DeepSeek-V4 (``state_kv``) layer only if it has
``forward_v4``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "AttentionBackend",
    "AttentionCapabilities",
    "AttentionKind",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "V4AttentionBackend",
    "attention_capabilities",
    "attention_unsupported",
]


class AttentionKind(str, Enum):
    FULL = "full"  # multi-head / grouped-query attention over the whole context
    MLA = "mla"  # multi-head latent attention (absorbed: one shared latent K=V head)
    SLIDING = "sliding"  # full attention restricted to the last `window` positions
    COMPRESSED_SPARSE = "compressed_sparse"  # DeepSeek-V4 CSA (compressor + indexer top-k)
    HEAVILY_COMPRESSED = "heavily_compressed"  # DeepSeek-V4 HCA


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static description of one attention layer; hashable, so backends may cache on it.

    For ``MLA`` the model passes queries already absorbed into the latent space: keys are
    ``head_dim`` wide (latent + rope part), there is one KV head, values are the first
    ``v_head_dim`` channels of the key (``kv_shared=True``).
    """

    kind: AttentionKind
    layer_index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    rope_dim: int = 0
    kv_shared: bool = False  # V is a prefix of K (MLA latent, DeepSeek-V4 K=V)
    window: int | None = None  # sliding window length, in tokens
    compress_ratio: int = 0
    index_topk: int = 0
    kv_dtype: torch.dtype = torch.float32
    # DeepSeek-V4 layout: the window lives in per-request state KV, compressed entries in block
    # KV, the cache is a ``V4LayerCache`` and the backend implements ``V4AttentionBackend``.
    state_kv: bool = False


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step batch layout, shared by every layer of one forward. All tensors live on the
    model's device; the two ``max_*`` ints are computed on the host when the batch is built so
    that backends never synchronise to learn shapes."""

    query_start_loc: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32, tokens in context after this step
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, where each new token's KV is written
    block_tables: torch.Tensor  # [R, max_blocks] int32
    block_size: int
    max_query_len: int
    max_seq_len: int
    batch_invariant: bool = False  # reductions must not depend on the rest of the batch
    state_slots: torch.Tensor | None = None  # [R] int64, each request's state-KV slot (V4)
    replay: bool = False  # tokens re-run only to rebuild state KV: read block KV, never write it
    # Host-side prompt length per request (None / 0: unknown). DeepSeek-V4's indexer ranks a
    # prompt row among all of the prompt's compressed entries, as a one-pass prefill does, so that
    # chunking breaks score ties the same way.
    prompt_lens: tuple[int, ...] | None = None
    # Host-side sum of ``seq_lens`` (0: unknown): lets a backend size per-step work on the context
    # (e.g. MLA's non-absorbed prefill, which decompresses every context token) without a sync.
    num_context_tokens: int = 0
    # Host-side count of the step's causal (query, key) pairs, summed over requests (0: unknown).
    num_attention_pairs: int = 0
    # Host-side copies of query_start_loc, seq_lens and state_slots as the batch was built (None:
    # unknown): a model that needs the layout on the host (DeepSeek-V4's compressor and indexer
    # plans) reads them instead of copying the tensors back from the device every forward.
    host_query_start_loc: tuple[int, ...] | None = None
    host_seq_lens: tuple[int, ...] | None = None
    host_state_slots: tuple[int, ...] | None = None
    # A model may attach a fresh dict per forward (dataclasses.replace) so that backends compute
    # what every layer shares (gather slots, decode masks) once per step instead of once per layer.
    # None: no memo (a meta reused across forwards, e.g. CUDA-graph capture, must not cache).
    scratch: dict | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class AttentionCapabilities:
    """The layer kinds an attention backend serves (its ``capabilities`` attribute).

    ``kinds``: kinds it serves through the paged ``forward`` (``state_kv=False`` specs: full,
    mla, sliding). ``state_kv_kinds``: DeepSeek-V4 kinds it serves through ``forward_v4``
    (``state_kv=True`` specs: sliding, compressed_sparse, heavily_compressed).
    """

    kinds: frozenset[AttentionKind] = frozenset()
    state_kv_kinds: frozenset[AttentionKind] = frozenset()

    def serves(self, spec: AttentionLayerSpec) -> bool:
        return spec.kind in (self.state_kv_kinds if spec.state_kv else self.kinds)


def attention_capabilities(backend: object) -> AttentionCapabilities | None:
    """The backend's declared :class:`AttentionCapabilities`, or None when it declares none (the
    previous contract). A declaration of another type is the plugin's mistake: ``TypeError``."""
    caps = getattr(backend, "capabilities", None)
    if caps is not None and not isinstance(caps, AttentionCapabilities):
        name = getattr(backend, "name", backend)
        raise TypeError(f"attention backend {name!r}: capabilities must be an AttentionCapabilities, got {caps!r}")
    return caps


def _kind_name(spec: AttentionLayerSpec) -> str:
    return f"DeepSeek-V4 {spec.kind.value}" if spec.state_kv else spec.kind.value


def attention_unsupported(backend: object, spec: AttentionLayerSpec) -> str | None:
    """Why ``backend`` cannot serve ``spec`` by its declaration; None when it can."""
    caps = attention_capabilities(backend)
    if caps is None:
        if spec.state_kv and not callable(getattr(backend, "forward_v4", None)):
            return f"{_kind_name(spec)} layers need forward_v4, which it does not have"
        return None
    if not caps.serves(spec):
        return f"it does not declare {_kind_name(spec)} layers (AttentionCapabilities)"
    return None


@runtime_checkable
class AttentionBackend(Protocol):
    """Computes one layer kind's attention over a paged KV cache. Called on the hot path.
    Optional: ``capabilities`` (an :class:`AttentionCapabilities`; absent means the previous
    contract, see the module docstring)."""

    name: str

    def kv_cache_shape(self, spec: AttentionLayerSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of this layer's KV cache tensor (allocated by the runner, dtype ``spec.kv_dtype``)."""
        ...

    def forward(
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,  # [T, H, head_dim]
        k: torch.Tensor,  # [T, Hkv, head_dim]
        v: torch.Tensor | None,  # [T, Hkv, v_head_dim]; None when spec.kv_shared
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, v_head_dim]
        """Write the new tokens' K/V at ``meta.slot_mapping``, then attend causally over each
        request's cached context. Must write before reading (a request's new tokens see each
        other)."""
        ...

    # Optional, MLA only (see docs/writing-plugins.md): ``expand_mla(spec, meta) -> bool`` and
    # ``forward_mla_expanded(spec, q [T, H, nope + rope], key [T, 1, latent + rope], kv_b_weight
    # [H, nope + v, latent], kv_cache, meta) -> [T, H, v]``: the step in the non-absorbed form
    # (keys and values decompressed per head), writing ``key`` to the cache as ``forward`` does.


@runtime_checkable
class V4AttentionBackend(Protocol):
    """Attention of one DeepSeek-V4 layer kind (``spec.state_kv``): SLIDING (window only),
    COMPRESSED_SPARSE (window + the indexer's chosen compressed entries) or HEAVILY_COMPRESSED
    (window + every visible compressed entry). One K=V head, per-head softmax sinks."""

    name: str

    def forward_v4(
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,  # [T, H, D] roped queries
        kv: torch.Tensor,  # [T, D] the new tokens' roped key (= value)
        sinks: torch.Tensor,  # [H] float32 sink logits
        cache,  # deepinfer_core.models.deepseek_v4.kv.V4LayerCache
        meta: AttentionMetadata,
        selected: torch.Tensor | None = None,  # [T, k] entry ids (-1: none), COMPRESSED_SPARSE only
    ) -> torch.Tensor:  # [T, H, D]
        """Read each request's last ``window - 1`` keys from its state ring (``meta.state_slots``),
        attend over them, the new keys and the compressed entries, then store the new keys in
        the ring. Entries of window ``w`` are visible to position ``p`` when ``(w + 1) * ratio
        <= p + 1``; they are read from ``cache.entries`` through ``meta.block_tables``. A replay
        (``meta.replay``) reads no ring rows: its window attention sees only the replayed tokens
        (positions from each request's first new token), as the bounded replay needs."""
        ...

    # Optional: ``index_scores(q, weights, entries, key_col, positions, batch, ratio, n_max, scale, meta)``
    # -> [T, n_max] float32 (or None to decline): the CSA indexer's masked scores for the whole
    # batch, which the model then ranks with its own top-k (see docs/writing-plugins.md).
