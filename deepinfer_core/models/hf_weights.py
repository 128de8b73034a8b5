"""Streaming Hugging Face tensors into a DeepSeek-style model (DeepSeek-V3 and V4 share it).

Our parameter names equal the Hugging Face names, so most tensors are a plain copy. Routed
experts come in one of two layouts and both land in the same stacked parameters::

    per expert (what transformers' save_pretrained and DeepSeek's checkpoints write)
        model.layers.L.mlp.experts.E.gate_proj.weight  [I, D] -> gate_up_proj[E, :I]
        model.layers.L.mlp.experts.E.up_proj.weight    [I, D] -> gate_up_proj[E, I:]
        model.layers.L.mlp.experts.E.down_proj.weight  [D, I] -> down_proj[E]
    fused (transformers 5's in-memory layout)
        model.layers.L.mlp.experts.gate_up_proj        [E, 2I, D]
        model.layers.L.mlp.experts.down_proj           [E, D, I]

Layers past ``num_hidden_layers`` are DeepSeek's multi-token-prediction modules; they are not
part of this model and are skipped, as transformers does. A model whose MTP modules are its own
parameters (DeepSeek-V4's ``mtp.N.*``) passes ``optional_prefix="mtp."``: each ``mtp.N`` group
is then loaded whole or, when the checkpoint has none of its tensors, left out (reported in the
returned set of loaded names; a partly present group is an error naming what is missing).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn as nn

from ..causal_lm import WeightsError
from .layers import fused_targets

_EXPERT = re.compile(
    r"^((?:model\.layers|mtp)\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SHOWN = 20  # names listed per category before summarising
_SCALE = ".scale"  # marks a per-expert weight_scale_inv piece


@torch.no_grad()
def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    family: str = "DeepseekV3",
    optional_prefix: str | None = None,
) -> set[str]:
    """Copy every tensor into place; raise :class:`WeightsError` naming all problems at once.
    Returns the names of the parameters filled (stacked expert parameters included)."""
    config = model.config
    num_layers = config["num_hidden_layers"]
    fused, fused_params = fused_targets(model)
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in fused_params} | fused
    required = set(targets)
    if config.get("tie_word_embeddings", False):
        required.discard("lm_head.weight")
    loaded: set[str] = set()
    pieces: dict[str, set[tuple[int, str]]] = {}  # "...mlp.experts" -> {(expert, proj)}
    unexpected: list[str] = []
    misshaped: list[str] = []

    for name, tensor in weights:
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= num_layers:
            continue  # MTP module
        expert = _EXPERT.match(name)
        if expert:
            prefix, index, proj = expert.group(1), int(expert.group(2)), expert.group(3)
            if expert.group(4):  # an FP8 expert's tile scales (kept FP8: models.fp8)
                proj += _SCALE
            dest = _expert_slice(targets, prefix, index, proj)
            if dest is None:
                unexpected.append(name)
            elif dest.shape != tensor.shape:
                misshaped.append(f"{name}: got {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            else:
                dest.copy_(tensor.to(dest.dtype))
                pieces.setdefault(prefix, set()).add((index, proj))
            continue
        target = targets.get(name)
        if target is None and tensor.numel() == 0:
            continue  # holds no weights: transformers writes zero-width shared experts for n_shared_experts 0
        if target is None:
            unexpected.append(name)
        elif target.shape != tensor.shape:
            misshaped.append(f"{name}: got {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        else:
            target.copy_(tensor.to(target.dtype))
            loaded.add(name)

    filled = loaded | {n for n in required - loaded if _filled_by_pieces(n, pieces, targets)}
    missing = sorted(required - filled)
    if optional_prefix is not None:
        present = {_group(n, optional_prefix) for n in filled | set(pieces)} - {None}
        missing = [n for n in missing if _group(n, optional_prefix) in present or _group(n, optional_prefix) is None]
    missing = _expand_expert_names(missing, pieces, targets)
    if missing or unexpected or misshaped:
        parts = []
        for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if names:
                more = f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
                parts.append(f"{label} tensors: {', '.join(names[:_SHOWN])}{more}")
        raise WeightsError(f"{family} checkpoint does not match the model; " + "; ".join(parts))
    return filled


def _group(name: str, prefix: str) -> str | None:
    """``mtp.0`` for ``mtp.0.self_attn...`` when ``prefix`` is ``mtp.``; None outside it."""
    if not name.startswith(prefix):
        return None
    return prefix + name[len(prefix) :].split(".", 1)[0]


def _expert_slice(targets: dict, prefix: str, index: int, proj: str) -> torch.Tensor | None:
    """The view of the stacked parameter that one per-expert tensor fills, or None."""
    proj, scale = proj.removesuffix(_SCALE), "_scale_inv" if proj.endswith(_SCALE) else ""
    stacked = targets.get(f"{prefix}.down_proj{scale}" if proj == "down_proj" else f"{prefix}.gate_up_proj{scale}")
    if stacked is None or index >= stacked.shape[0]:
        return None
    if proj == "down_proj":
        return stacked[index]  # [D, I]
    half = stacked.shape[1] // 2
    return stacked[index, :half] if proj == "gate_proj" else stacked[index, half:]  # [I, D]


def _projections_of(stacked_name: str) -> tuple[str, ...]:
    base = stacked_name.removesuffix("_scale_inv")
    projs = ("down_proj",) if base.endswith(".down_proj") else ("gate_proj", "up_proj")
    return tuple(p + _SCALE for p in projs) if base != stacked_name else projs


def _piece_name(prefix: str, expert: int, proj: str) -> str:
    scale = "_scale_inv" if proj.endswith(_SCALE) else ""
    return f"{prefix}.{expert}.{proj.removesuffix(_SCALE)}.weight{scale}"


def _filled_by_pieces(name: str, pieces: dict, targets: dict) -> bool:
    prefix, _, _ = name.rpartition(".")
    if prefix not in pieces or not prefix.endswith(".mlp.experts") or name not in targets:
        return False
    num_experts = targets[name].shape[0]
    have = pieces[prefix]
    return all((e, p) in have for e in range(num_experts) for p in _projections_of(name))


def _expand_expert_names(missing: list[str], pieces: dict, targets: dict) -> list[str]:
    """When a checkpoint uses the per-expert layout but lacks some experts, name the exact
    per-expert tensors instead of the stacked parameter nobody wrote."""
    out = []
    for name in missing:
        prefix, _, _ = name.rpartition(".")
        if prefix in pieces:
            have = pieces[prefix]
            out += [
                _piece_name(prefix, e, p)
                for e in range(targets[name].shape[0])
                for p in _projections_of(name)
                if (e, p) not in have
            ]
        else:
            out.append(name)
    return out
