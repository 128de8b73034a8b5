"""Weight formats: how a checkpoint's weights are held in memory and multiplied (``deepinfer_weight_format``).

vLLM calls this a quantization method. The loader says what the checkpoint stores, in neutral
terms (a :class:`WeightsRequest`, and :class:`QuantizedTensor` for a block-quantized tensor: its
GGML type, shape and raw bytes); a :class:`WeightFormat` a plugin returns decides which of those
weights it claims, packs them at load and swaps in the modules that run them::

    fmt = host.weight_format(WeightsRequest(...), platform)     # None: dense weights
    model = factory(config, ModelContext(dtype=fmt.compute_dtype, kv_dtype=fmt.kv_cache_dtype(..),
                                         attention_backend=lambda s: fmt.attention_backend(s, chosen(s))))
    if fmt.prepare(model):                  # its modules replace nn.Linear / nn.Embedding ...
        model.load_weights(fmt.weights(files))   # ... and receive the packed tensors
    else:
        model.load_weights(files.weights())

A module a format swaps in tells the model's ``load_weights`` where each checkpoint tensor goes
through ``checkpoint_slots(module_name) -> (targets, own parameter names)`` (a target is a
tensor view to copy into, or an object with ``shape`` and ``fill(tensor)``); a module used as
the LM head offers ``project(hidden) -> logits`` and may offer ``greedy_argmax(hidden, threads,
screened) -> [N] int64 | None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["QuantizedTensor", "WeightFormat", "WeightsRequest"]

if TYPE_CHECKING:
    import torch.nn as nn

    from .attention import AttentionBackend, AttentionLayerSpec


@dataclass(frozen=True)
class QuantizedTensor:
    """One block-quantized checkpoint tensor as the file stores it, not decoded.

    ``raw`` is ``[N, bytes per row]`` uint8 (a view of the file's memory map); ``row_order``,
    when set, says which stored row each row of the model's tensor is (a loader's layout change,
    e.g. the rotary row order of llama.cpp's Q/K projections): ``model_rows = stored[row_order]``."""

    type_name: str  # the GGML type: "Q4_0", "Q4_K", "Q8_0", "Q6_K", ...
    shape: tuple[int, int]  # [N, K] values
    raw: np.ndarray = field(repr=False)
    row_order: torch.Tensor | None = field(default=None, repr=False)  # [N] int64

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, rows in the model's order
        import gguf

        values = gguf.quants.dequantize(self.raw, gguf.GGMLQuantizationType[self.type_name])
        dense = torch.from_numpy(np.array(values, dtype=np.float32).reshape(self.shape))
        return dense if self.row_order is None else dense[self.row_order]


@dataclass(frozen=True)
class WeightsRequest:
    """What a checkpoint stores and what the user asked for; a weight format claims from this."""

    source: str  # the checkpoint's path
    quantized_names: frozenset[str]  # checkpoint names of its block-quantized 2-D tensors (empty: float checkpoint)
    quantized_types: frozenset[str]  # their GGML types ("Q4_1", "Q8_0", ...)
    dtype: str  # EngineConfig.dtype as given: "auto", "lowbit", "float32", "bfloat16", ...
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype as given
    # EngineConfig.weight_format as given (a plugin name, "builtin", or None: the default order).
    # A format that only serves on request (one that quantizes a float checkpoint at load)
    # claims when this is its plugin's name and declines otherwise.
    requested: str | None = None


@runtime_checkable
class WeightFormat(Protocol):
    """A way of holding and multiplying weights, chosen once per engine (see the module docstring)."""

    name: str
    # Why it cannot serve here (no kernels on this CPU, not built, ...): the engine then loads the
    # weights dense and writes this reason in its start-up line. None: it serves.
    unavailable: str | None
    # The activations' dtype its modules need (the low-bit kernels read and write float32), or
    # None: the engine's dtype.
    compute_dtype: torch.dtype | None
    description: str  # how the weights are held and why, for the start-up line

    def kv_cache_dtype(self) -> torch.dtype | None:
        """The KV cache's element type for ``WeightsRequest.kv_cache_dtype`` (raise ValueError
        naming the allowed values for one it refuses), or None: the compute dtype, as dense."""
        ...

    def attention_backend(self, layer: AttentionLayerSpec, chosen: AttentionBackend) -> AttentionBackend:
        """The backend a layer of a model with these weights uses, given the one
        ``deepinfer_attention_backend`` chose (return ``chosen`` to keep it)."""
        ...

    def prepare(self, model: nn.Module) -> int:
        """Replace, before any weight is loaded, the modules whose weights this format holds;
        return how many (0: nothing of this model is claimed, the engine loads it dense)."""
        ...

    def weights(self, files) -> Iterator[tuple[str, object]]:
        """The checkpoint's ``(name, tensor)`` stream for a prepared model: claimed tensors in
        this format's packed form (for its modules' slots), every other one as a float tensor.
        ``files`` is the opened checkpoint (``models.loaders.files.ModelFiles``): ``weights()``
        streams float tensors, ``quantized_weights()`` block-quantized ones as
        :class:`QuantizedTensor` (float ones as tensors)."""
        ...

    def describe(self, model: nn.Module) -> str:
        """What the model's weights are, e.g. ``"low-bit: 120 q4<Q4_1>, 1 q8<Q8_0>"``; part of
        the KV cache namespace (two formats compute different keys and values)."""
        ...

    def use_batch_invariant_kernels(self, model: nn.Module) -> None:
        """Make every module of this format compute a row the same whatever the batch
        (``batch_invariant=True`` engines)."""
        ...
