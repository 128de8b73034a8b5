"""Model architectures, one package each (``llama``, ``deepseek_v3``, ``deepseek_v4``), the layers
and weight helpers they share, and the readers of model files (``loaders``, by file type).

Registered by HF architecture name through ``deepinfer_register_models``. What a model must
offer the engine (:class:`CausalLM`, :class:`ModelContext`, the factory and source types) is part
of the contract, in :mod:`deepinfer_core.causal_lm`, and named here too.
"""

from ..causal_lm import (
    CausalLM,
    FusedDecodeStep,
    ModelContext,
    ModelFactory,
    ModelFilesNotFound,
    ModelSource,
    WeightsError,
)

__all__ = [
    "CausalLM",
    "FusedDecodeStep",
    "ModelContext",
    "ModelFactory",
    "ModelFilesNotFound",
    "ModelSource",
    "WeightsError",
]
