"""deepinfer: a hardware-neutral inference engine core; plugins add hardware, storage and protocols."""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `deepinfer plugins` and plugin discovery do not import the whole engine.
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from .engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
