"""The low-bit weight format: a block-quantized GGUF's tensors kept packed on CPU.

Claimed (``deepinfer_weight_format``) when the checkpoint has block-quantized 2-D tensors, the
platform is the CPU and the dtype is ``auto`` (or its explicit name ``lowbit``); a float dtype
pins dense weights. :meth:`LowBitWeightFormat.prepare` swaps :class:`~deepinfer_core.lowbit.modules.LowBitLinear`
/ ``LowBitEmbedding`` in for every linear layer (fused or not) whose checkpoint tensors are all
block-quantized and whose input width is a multiple of 32, and for a quantized ``embed_tokens``;
:meth:`weights` packs the loader's :class:`~deepinfer_core.weight_format.QuantizedTensor` into
the kernels' formats (``lowbit.formats``). Activations are float32, which the kernels read and
write, over the KV cache dtype :func:`~deepinfer_core.lowbit.attention.kv_dtype` chooses, and
one-token attention rows read that cache in C (:class:`~deepinfer_core.lowbit.attention.PagedDecodeAttention`).
Where the kernels cannot be built here the format says why (``unavailable``) and the engine
loads the same file dequantized.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

from ...lowbit import describe_weights, native
from ...lowbit.attention import kv_dtype, paged_decode
from ...lowbit.formats import QK, from_gguf
from ...lowbit.modules import LowBitEmbedding, LowBitLinear, use_exact_kernels
from ...lowbit.threads import adaptive_enabled
from ...weight_format import QuantizedTensor, WeightsRequest
from .llama_decode import prefill_enabled

CLAIMED_DTYPES = ("auto", "lowbit")  # a float dtype pins dense weights (float32: the exact reference)


class LowBitWeightFormat:
    """Implements :class:`deepinfer_core.weight_format.WeightFormat`."""

    name = "lowbit"
    compute_dtype = torch.float32

    def __init__(self, request: WeightsRequest) -> None:
        self.request = request
        kernels = native.load()
        self.lib = kernels.lib
        self.unavailable = kernels.reason or None
        self.description = (
            "block-quantized GGUF on CPU: weights kept packed (dtype=float32 for the dequantized reference), "
            f"kernels {native.describe_isa(kernels.isa)}"
        )
        self._claimed: frozenset[str] = frozenset()

    def kv_cache_dtype(self) -> torch.dtype:
        return kv_dtype(self.request.quantized_types, self.request.kv_cache_dtype)

    def attention_backend(self, layer, chosen):
        return paged_decode(chosen, self.lib)

    def prepare(self, model: nn.Module) -> int:
        adaptive_enabled()  # a bad DEEPINFER_ADAPTIVE_THREADS is refused here, not at the first decode step
        prefill_enabled()  # and a bad DEEPINFER_NATIVE_PREFILL
        replaced = swap_in_lowbit(model, set(self.request.quantized_names))
        self._claimed = frozenset(
            name
            for module_name, module in model.named_modules()
            if isinstance(module, (LowBitLinear, LowBitEmbedding))
            for name in module.checkpoint_slots(module_name)[0]
        )
        return replaced

    def weights(self, files) -> Iterator[tuple[str, object]]:
        """Claimed tensors packed; a block-quantized tensor no module claims (an input width
        that is not a multiple of 32) dequantized from the same packed values, as before."""
        for name, tensor in files.quantized_weights():
            if isinstance(tensor, QuantizedTensor):
                packed = from_gguf(tensor.type_name, tensor.raw, tensor.shape)
                if tensor.row_order is not None:
                    packed = packed.rows(tensor.row_order)
                yield name, (packed if name in self._claimed else packed.dequantize())
            else:
                yield name, tensor

    def describe(self, model: nn.Module) -> str:
        return describe_weights(model)

    def use_batch_invariant_kernels(self, model: nn.Module) -> None:
        use_exact_kernels(model)  # the integer kernels are taken by row count: keep the exact one


def swap_in_lowbit(model: nn.Module, quantized: set[str]) -> int:
    """Replace every ``nn.Linear`` (fused or not) whose checkpoint weights are all in
    ``quantized`` and whose input width is a multiple of 32, and a quantized ``embed_tokens``.
    Returns how many modules were replaced."""
    replaced = 0
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        prefix = f"{parent_name}." if parent_name else ""
        new: nn.Module | None = None
        if isinstance(module, nn.Linear) and module.in_features % QK == 0:
            parts = getattr(module, "parts", None) or {attr: slice(0, module.out_features)}
            if all(f"{prefix}{p}.weight" in quantized for p in parts):
                new = LowBitLinear(module.in_features, parts, module.bias)
        elif isinstance(module, nn.Embedding) and attr == "embed_tokens" and f"{name}.weight" in quantized:
            if module.embedding_dim % QK == 0:
                new = LowBitEmbedding(module.num_embeddings, module.embedding_dim)
        if new is not None:
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
            replaced += 1
    return replaced
