"""deepinfer: a hardware-neutral inference engine core; plugins add hardware, storage and protocols."""

from __future__ import annotations

import os as _os
import sys as _sys

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
__version__ = "0.1.0"

# torch >= 2.5 imports every installed device extension (the "torch.backends" entry points) in
# `import torch`; a torch_npu without CANN makes that raise, and with it every deepinfer command.
# No deepinfer plugin needs the auto-load (the Ascend plugin probes torch_npu in a subprocess and
# imports it itself), so it is off unless the user set it or torch is already imported.
if "torch" not in _sys.modules:
    _os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


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
