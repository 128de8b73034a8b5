"""How many bytes the KV cache takes, computed once for the engine and for ``deepinfer plan``.

The engine allocates exactly what :func:`kv_sizing` describes, and ``deepinfer plan`` reports the
same numbers from a model built on the meta device (no weights, no memory), so a capacity plan
made before buying cards is the allocation the engine will make.

Two cache families:

* **paged only** (Llama GQA, DeepSeek-V3 MLA...): each layer's cache tensor has the shape the
  attention backend gives for ``num_blocks`` blocks (:meth:`AttentionBackend.kv_cache_shape`);
* **block KV + state KV** (DeepSeek-V4, models with ``kv_layout``): paged block KV plus a state
  slot per running request (``max_num_seqs + 1``: one extra for ``prompt_logits``), sized by the
  model's layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .zeroed import zeros


@dataclass(frozen=True)
class KVSizing:
    block_size: int  # tokens per block
    block_bytes: int  # block KV of one block, all layers
    block_bytes_by_kind: tuple[tuple[str, int, int], ...]  # (layer kind, layers, bytes per block)
    state_bytes_per_request: int  # 0 for paged-only caches
    num_state_slots: int
    layout: str  # names the cache layout (goes into the prefix-cache namespace)
    _allocate: Callable[[int, torch.device], list]

    @property
    def state_bytes(self) -> int:
        """State KV allocated beside the blocks, whatever the number of blocks."""
        return self.num_state_slots * self.state_bytes_per_request

    def total_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_bytes + self.state_bytes

    def blocks_for_budget(self, budget_bytes: float) -> int:
        """The most blocks that fit in ``budget_bytes`` next to the state KV."""
        blocks = int((budget_bytes - self.state_bytes) // self.block_bytes)
        if blocks < 1:
            need = (self.block_bytes + self.state_bytes) / 2**30
            raise ValueError(
                f"a KV budget of {budget_bytes / 2**30:.4g} GiB holds no KV block: one block plus the state KV of "
                f"{self.num_state_slots} requests needs {need:.4g} GiB"
            )
        return blocks

    def allocate(self, num_blocks: int, device: torch.device) -> list:
        """The cache objects the model runs on (zeros), exactly :meth:`total_bytes` in size."""
        return self._allocate(num_blocks, device)


def kv_sizing(
    model, attention_backend: Callable, block_size: int, max_num_seqs: int, num_speculative_tokens: int = 0
) -> KVSizing:
    """Sizing of ``model``'s KV cache; ``attention_backend(spec)`` resolves each layer's backend
    (the engine's resolver, so plugin backends' cache shapes count)."""
    if hasattr(model, "kv_layout"):
        layout = (
            model.kv_layout(block_size, num_speculative_tokens)
            if num_speculative_tokens
            else model.kv_layout(block_size)
        )
        slots = max_num_seqs + 1
        kinds: dict[str, list[int]] = {}
        for layer in layout.layers:
            entry = kinds.setdefault(layer.kind, [0, 0])
            entry[0] += 1
            entry[1] += layer.block_elems() * layout.dtype.itemsize
        return KVSizing(
            block_size=block_size,
            block_bytes=layout.block_bytes,
            block_bytes_by_kind=tuple((k, n, b) for k, (n, b) in kinds.items()),
            state_bytes_per_request=layout.state_bytes_per_request,
            num_state_slots=slots,
            layout=layout.describe(),
            _allocate=lambda n, device: layout.allocate(n, slots, device),
        )
    specs = model.attention_specs
    backends = [attention_backend(spec) for spec in specs]
    shapes = [b.kv_cache_shape(spec, 1, block_size) for b, spec in zip(backends, specs)]
    per_layer = [math.prod(s) * spec.kv_dtype.itemsize for s, spec in zip(shapes, specs)]
    kinds = {}
    for spec, nbytes in zip(specs, per_layer):
        entry = kinds.setdefault(spec.kind.value, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def allocate(num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        # zero pages on first write (CPU): no start-up pass over the whole cache (zeroed.py)
        return [
            zeros(b.kv_cache_shape(spec, num_blocks, block_size), spec.kv_dtype, device)
            for b, spec in zip(backends, specs)
        ]

    return KVSizing(
        block_size=block_size,
        block_bytes=sum(per_layer),
        block_bytes_by_kind=tuple((k, n, b) for k, (n, b) in kinds.items()),
        state_bytes_per_request=0,
        num_state_slots=0,
        layout=";".join(f"{b.name}:{s}:{spec.kv_dtype}" for b, s, spec in zip(backends, shapes, specs)),
        _allocate=allocate,
    )


def cache_bytes(caches) -> int:
    """Bytes actually held by allocated cache objects (tensors, or dataclasses of tensors)."""
    total = 0
    for cache in caches:
        if isinstance(cache, torch.Tensor):
            total += cache.numel() * cache.element_size()
        else:
            total += sum(t.numel() * t.element_size() for t in vars(cache).values() if isinstance(t, torch.Tensor))
    return total
