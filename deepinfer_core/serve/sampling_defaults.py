"""Sampling defaults for requests that leave them unset: the model's recommendation first.

The APIs document temperature 1 and top-p 1 as their defaults, which suits the large models they
were written for; a small model sampled at temperature 1 wanders off within a few tokens (the
embedded SmolLM2-135M answers "What is the capital of France?" with fiction). Like vLLM's
``--generation-config auto``, the server takes the model's own recommendation where the model
ships one and a request does not say otherwise:

1. a Hugging Face checkpoint's ``generation_config.json`` (``temperature``, ``top_p``, ``top_k``
   when present; ``do_sample: false`` alone means greedy),
2. a GGUF's ``general.sampling.temp`` / ``.top_p`` / ``.top_k`` keys,
3. for the embedded default model, the values its model card uses (temperature 0.2, top-p 0.9).

``deepinfer serve --sampling-defaults protocol`` keeps each API's documented defaults instead.
A value a request sends always wins.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..models.loaders.files import ModelFiles

log = logging.getLogger(__name__)

# SmolLM2-135M-Instruct's model card samples with these (HuggingFaceTB/SmolLM2-135M-Instruct).
EMBEDDED_RECOMMENDATION = {"temperature": 0.2, "top_p": 0.9}
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    source: str = "the protocol's documented defaults"

    def describe(self) -> str:
        return f"temperature={self.temperature:g} top_p={self.top_p:g} top_k={self.top_k} ({self.source})"


def _checked(values: dict, source: str) -> SamplingDefaults:
    """Only well-formed values are taken; a malformed file falls back to the protocol defaults
    with a warning rather than refusing to serve."""
    out = SamplingDefaults(source=source)
    try:
        temperature = float(values.get("temperature", out.temperature))
        top_p = float(values.get("top_p", out.top_p))
        top_k = int(values.get("top_k", out.top_k))
    except (TypeError, ValueError):
        log.warning("ignoring malformed sampling defaults in %s: %r", source, values)
        return SamplingDefaults()
    if not (0.0 <= temperature <= 2.0 and 0.0 < top_p <= 1.0 and top_k >= 0):
        log.warning("ignoring out-of-range sampling defaults in %s: %r", source, values)
        return SamplingDefaults()
    return SamplingDefaults(temperature, top_p, top_k, source)


def _from_generation_config(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    values = {k: config[k] for k in ("temperature", "top_p", "top_k") if config.get(k) is not None}
    if config.get("do_sample") is False and "temperature" not in values:
        values["temperature"] = 0.0
    return values or None


def _from_gguf_keys(stored: dict) -> dict | None:
    values = {name: stored[key] for key, name in _GGUF_KEYS.items() if key in stored}
    return values or None


def _read_gguf_keys(path: str) -> dict:
    """The ``general.sampling.*`` keys of ``path``'s header, the other values stepped over
    (no vocabulary is decoded); {} for a file that cannot be read."""
    from ..models.loaders.gguf_index import read_index

    try:
        return read_index(path, lambda key: key in _GGUF_KEYS).metadata
    except (OSError, ValueError):
        return {}


def model_sampling_defaults(model_path: str, files: "ModelFiles | None" = None) -> SamplingDefaults:
    """What the model at ``model_path`` recommends, or the protocol defaults. ``files``: the
    engine's opened model, whose GGUF keys the loader already holds (no second read)."""
    if os.path.isdir(model_path):
        config = os.path.join(model_path, "generation_config.json")
        if (values := _from_generation_config(config)) is not None:
            return _checked(values, config)
    elif model_path.endswith(".gguf"):
        stored = files.sampling if files is not None and files.source == model_path else _read_gguf_keys(model_path)
        if (values := _from_gguf_keys(stored)) is not None:
            return _checked(values, f"{os.path.basename(model_path)} general.sampling.*")
        from ..models.sources import smollm2_gguf

        embedded = smollm2_gguf()
        if embedded is not None and os.path.realpath(embedded) == os.path.realpath(model_path):
            return _checked(EMBEDDED_RECOMMENDATION, "the SmolLM2-135M-Instruct model card")
    return SamplingDefaults()
