"""Low-bit weights on CPU: GGUF block-quantized tensors served packed (4, 5 or 8 bits per value, a
scale per 32 values) and multiplied by AVX2 kernels that widen each block in registers, so a
step reads 4-8x fewer weight bytes than float32. Every call rounds the activations to int16
per 32-block and uses exact integer dot products (``kernels_i16.c``; ``ops`` says why,
``DEEPINFER_LOWBIT_EXACT=1`` keeps float32 activations everywhere). The KV cache of this
path is float16 (``attention.kv_dtype``): decode attention at many requests is bounded by its
reads of the cache; ``kv_cache_dtype="int8"`` (opt-in) halves those bytes again (codes and a
scale per row, docs/kv-cache-dtype.md). An int8-activation kernel for 4-bit weights (llama.cpp's
arithmetic, ~2x faster from 5 rows on) is opt-in through ``DEEPINFER_LOWBIT_INT8_ROWS``: it
loses the float32 model's greedy tokens.

``formats`` packs GGUF blocks, ``native`` builds and loads the AVX2 kernels (with VNNI where the
CPU has it: ``DEEPINFER_LOWBIT_ISA``), ``ops`` calls them, ``modules`` holds the packed layers,
``attention`` the paged decode attention, ``threads`` the decode step's thread chooser. This
package is the kernel layer: it imports nothing from ``models``, ``engine`` or ``builtin``, and
only the builtin plugin ``core.lowbit`` (``deepinfer_core.builtin.lowbit``) imports it: the
engine reaches it through that plugin's hooks. Where the kernels cannot run (no AVX2, no C
compiler), :func:`native.load` says why and the engine loads the same file dequantized instead.
"""

from __future__ import annotations

from collections import Counter

import torch.nn as nn


def describe_weights(model: nn.Module) -> str:
    """``"low-bit: 210 q4<Q4_1>, 1 q8<Q8_0>"`` for a model with packed modules, else ``"dense"``."""
    from .modules import LowBitEmbedding, LowBitLinear

    kinds: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, LowBitLinear):
            kinds.update(f"{w.kind}<{w.source}>" for w in module.segments)
        elif isinstance(module, LowBitEmbedding) and module.weight_q is not None:
            kinds[f"{module.weight_q.kind}<{module.weight_q.source}>"] += 1
    if not kinds:
        return "dense"
    return "low-bit: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
