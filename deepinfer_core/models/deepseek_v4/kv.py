"""DeepSeek-V4 KV cache layout: block KV (paged, prefix-cacheable) and state KV (per request).

Per layer, what a request needs to continue from position ``p`` splits in two::

    block KV  (engine blocks of block_size tokens, hash-chained like every other model)
        CSA  entries [block_size / ratio, head_dim + index_head_dim]   compressed KV | indexer key
        HCA  entries [block_size / ratio, head_dim]                     compressed KV
        sliding: nothing
    state KV  (one slot per running request, overwritten as it advances)
        window  [window - 1 + speculative, head_dim]   ring of the last keys (K = V), by pos % rows
        tail    [2 * ratio (CSA) | ratio (HCA)          raw compressor (and indexer) projections
                 + speculative, width]
                                                       kv | gate of the last positions, by pos % rows

Compressed entry ``w`` summarises positions ``[w * ratio, (w + 1) * ratio)`` and lives in the
request's block ``w * ratio // block_size``; so ``block_size % ratio == 0`` is required. A CSA
entry also reads the previous window's first-half projections, which is why its tail keeps two
windows. Everything in state KV is a function of the last ``window - 1`` (window ring) or
``2 * ratio`` (tails) tokens' layer inputs, so it can be rebuilt by replaying tokens.

:func:`v4_kv_layout` is the one place these sizes are computed: the engine allocates from it and
capacity planning reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CSA, HCA, V4Config, parse_config


@dataclass(frozen=True)
class V4LayerKV:
    """Shapes of one layer's caches (rows x width; element type is the layout's dtype)."""

    kind: str
    compress_ratio: int  # 0: sliding only
    entries_per_block: int  # compressed entries per engine block
    entry_width: int  # head_dim (+ index_head_dim for CSA)
    window_rows: int
    head_dim: int
    tail_rows: int
    tail_width: int  # compressor kv|gate (+ indexer kv|gate for CSA)

    def block_elems(self) -> int:
        return self.entries_per_block * self.entry_width

    def state_elems(self) -> int:
        return self.window_rows * self.head_dim + self.tail_rows * self.tail_width


@dataclass(frozen=True)
class V4LayerCache:
    """One layer's cache tensors, as the model and the V4 attention backends see them."""

    entries: torch.Tensor  # [num_blocks, entries_per_block, entry_width]
    window: torch.Tensor  # [num_state_slots, window_rows, head_dim]
    tail: torch.Tensor  # [num_state_slots, tail_rows, tail_width]


@dataclass(frozen=True)
class V4KVLayout:
    layers: tuple[V4LayerKV, ...]
    block_size: int
    dtype: torch.dtype
    num_speculative_tokens: int

    @property
    def block_bytes(self) -> int:
        """Bytes of block KV per engine block (all layers)."""
        return sum(layer.block_elems() for layer in self.layers) * self.dtype.itemsize

    @property
    def state_bytes_per_request(self) -> int:
        """Bytes of state KV one running request holds (all layers)."""
        return sum(layer.state_elems() for layer in self.layers) * self.dtype.itemsize

    @property
    def exact_replay_tokens(self) -> int:
        """Tokens to re-run before a prefix hit so that every layer's state KV is exact: layer
        ``l``'s input is exact ``l * (window - 1)`` positions into a replay, and its state needs
        the last ``max(window - 1, tail rows)`` positions."""
        back = self.layers[0].window_rows - self.num_speculative_tokens if self.layers else 0
        return max((l * back + max(back, layer.tail_rows) for l, layer in enumerate(self.layers)), default=0)

    def block_bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.kind] = out.get(layer.kind, 0) + layer.block_elems() * self.dtype.itemsize
        return out

    def describe(self) -> str:
        """Stable text naming the layout (goes into the prefix-cache namespace)."""
        parts = [f"{l.kind}:{l.compress_ratio}:{l.entries_per_block}x{l.entry_width}" for l in self.layers]
        return f"v4|bs={self.block_size}|{self.dtype}|" + ";".join(parts)

    def allocate(self, num_blocks: int, num_state_slots: int, device) -> list[V4LayerCache]:
        def zeros(*shape):
            return torch.zeros(shape, dtype=self.dtype, device=device)

        return [
            V4LayerCache(
                entries=zeros(num_blocks, l.entries_per_block, l.entry_width),
                window=zeros(num_state_slots, l.window_rows, l.head_dim),
                tail=zeros(num_state_slots, l.tail_rows, l.tail_width),
            )
            for l in self.layers
        ]


def layer_layouts(cfg: V4Config, block_size: int, num_speculative_tokens: int = 0) -> tuple[V4LayerKV, ...]:
    layers = []
    for i, (kind, ratio) in enumerate(zip(cfg.layer_kinds, cfg.compress_ratios)):
        if ratio and block_size % ratio:
            raise ValueError(
                f"DeepSeek-V4 layer {i} ({kind}) compresses every {ratio} tokens, which does not divide the "
                f"KV block size {block_size}; use a block_size that is a multiple of {ratio}"
            )
        entry_width = cfg.head_dim + (cfg.index_head_dim if kind == CSA else 0)
        if kind == CSA:
            tail_rows, tail_width = 2 * ratio, 4 * cfg.head_dim + 4 * cfg.index_head_dim
        elif kind == HCA:
            tail_rows, tail_width = ratio, 2 * cfg.head_dim
        else:
            tail_rows, tail_width = 0, 0
        layers.append(
            V4LayerKV(
                kind=kind,
                compress_ratio=ratio,
                entries_per_block=block_size // ratio if ratio else 0,
                entry_width=entry_width if ratio else 0,
                window_rows=max(1, cfg.window - 1 + num_speculative_tokens),
                head_dim=cfg.head_dim,
                # drafts past the last committed position write the tail ring too: keep the rows a
                # later window close still reads (as the window ring does)
                tail_rows=tail_rows + (num_speculative_tokens if tail_rows else 0),
                tail_width=tail_width,
            )
        )
    return tuple(layers)


def v4_kv_layout(
    config: dict | V4Config, dtype: torch.dtype, block_size: int = 128, num_speculative_tokens: int = 0
) -> V4KVLayout:
    """The V4 cache layout for a Hugging Face config dict (or a parsed :class:`V4Config`):
    bytes per block of block KV, state KV bytes per request, and the allocator the engine uses."""
    cfg = config if isinstance(config, V4Config) else parse_config(config)
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    return V4KVLayout(layer_layouts(cfg, block_size, num_speculative_tokens), block_size, dtype, num_speculative_tokens)
