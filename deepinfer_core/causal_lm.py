"""What a model is to the engine: the :class:`CausalLM` protocol, the :class:`ModelContext` it is
built with, model factories and sources, and the errors a model or its files raise.

Part of the contract (the layer ``hookspecs`` names, below every implementation); the
architectures themselves live in ``deepinfer_core.models``, registered by HF architecture name
through ``deepinfer_register_models``. A :data:`ModelFactory` builds a :class:`CausalLM` from a
Hugging Face style config dict and a :class:`ModelContext`; the loader then streams weights into
it under their Hugging Face names. Models never pick kernels themselves: attention and MoE go
through the objects the context's resolvers return (the platform hooks).
"""

from __future__ import annotations

__all__ = [
    "CausalLM",
    "FusedDecodeStep",
    "ModelContext",
    "ModelFactory",
    "ModelFilesNotFound",
    "ModelSource",
    "WeightsError",
]

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, runtime_checkable

import torch

from .attention import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from .moe import MoEDispatcher, MoESpec

if TYPE_CHECKING:
    from .parallel.load import ExpertLoadCounter


@dataclass(frozen=True)
class ModelContext:
    """Everything a model needs from the engine, passed explicitly (no global context)."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: Callable[[AttentionLayerSpec], AttentionBackend]
    moe_dispatcher: Callable[[MoESpec], MoEDispatcher]
    # the KV cache's element type where it differs from ``dtype`` (None: ``dtype``); a weight
    # format may choose it (the low-bit CPU path: float32 activations over a float16 cache)
    kv_dtype: torch.dtype | None = None
    # per-expert load for EPLB (engine option expert_load_window): a MoE layer adds its row at
    # build time (add_layer) and its router's choices each forward (record); None: not counted
    expert_load: ExpertLoadCounter | None = None
    # called with the whole model while it is still on the meta device, just before it is
    # allocated (models.fast_init.allocate): the loader swaps in the modules that keep a
    # checkpoint's FP8 / MXFP4 weights packed there, so their dense stand-ins never take memory
    swap_modules: Callable[[torch.nn.Module], None] | None = None


class WeightsError(ValueError):
    """Missing, unexpected or mis-shaped tensors; the message names them."""


class ModelFilesNotFound(FileNotFoundError, ValueError):
    """No model where a path points (or a directory without weights). Both a
    ``FileNotFoundError`` and a ``ValueError``, so callers catching bad input catch it too."""


@runtime_checkable
class CausalLM(Protocol):
    config: dict
    attention_specs: list[AttentionLayerSpec]  # one per KV-cached layer, in cache order
    vocab_size: int
    max_position_embeddings: int

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume ``(hf_name, tensor)`` pairs; raise :class:`WeightsError` naming every missing,
        unexpected or mis-shaped tensor."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per attention_specs entry
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, D] final hidden states (after the last norm)
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] float32
        ...


@runtime_checkable
class FusedDecodeStep(Protocol):
    """A whole forward step in one call (``deepinfer_fused_decode_step``): a model that has a
    ``fused_step`` attribute offers each step to it first and runs its own layers when it
    declines. Results must equal the model's own forward (the same tokens)."""

    def run(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor | None:  # [T] -> [T, D] final hidden states (after the last norm), or None: not this step
        ...


ModelFactory = Callable[[dict, ModelContext], CausalLM]
# A model source resolves an alias ("smollm2-135m-instruct") to a local file or directory,
# or None when the package that ships it is not installed.
ModelSource = Callable[[], "str | None"]
