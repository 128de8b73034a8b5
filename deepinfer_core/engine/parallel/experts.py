"""A model's expert-parallel MoE layers, found the generic way, and the rank's share of them.

A rank loads only its experts: before the checkpoint is read, each layer's stacked expert tensors
are re-made with the rank's ``S / ep_size`` slots (:func:`keep_local_slots`), and the weight
stream is rewritten (:func:`local_expert_weights`): a per-expert tensor
(``...layers.L.mlp.experts.E.gate_proj.weight``, or DeepSeek's ``...ffn.experts.E.w1.weight``)
goes to every local slot holding expert ``E`` under that slot's number and is dropped when none
does; a fused one (``...experts.gate_up_proj [E, ...]``) keeps the local experts' rows.

A MoE layer is any module holding a ``dispatcher`` (an expert-parallel one: it has
``local_logical_experts``) next to its stacked ``experts`` (tensors with the experts along dim 0:
``gate_up_proj``, ``down_proj`` and, for FP8 experts, their scales). Only the layers of the main
forward count (a DeepSeek-V4 MTP block's MoE has ``layer_index >= num_hidden_layers``): their
order is the order of the expert exchanges in every forward pass, which an empty pass repeats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from ...moe import ExpertWeights, MoESpec

__all__ = ["MoELayer", "empty_pass", "keep_local_slots", "local_expert_weights", "moe_layers", "prepare_rank_model"]

_PER_EXPERT = re.compile(r"^(?P<pre>(?:.*\.)?layers\.(?P<layer>\d+)\.\w+\.experts\.)(?P<expert>\d+)(?P<rest>\..+)$")
_FUSED = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.\w+\.experts\.(?:gate_up_proj|down_proj)")


@dataclass(frozen=True)
class MoELayer:
    spec: MoESpec
    dispatcher: object
    module: nn.Module  # holds ``experts`` (its stacked tensors) and ``dispatcher``

    @property
    def experts_module(self) -> nn.Module:
        return self.module.experts

    def weights(self) -> ExpertWeights:
        e = self.experts_module
        return ExpertWeights(
            gate_up=e.gate_up_proj,
            down=e.down_proj,
            gate_up_scale=getattr(e, "gate_up_scale", None),
            down_scale=getattr(e, "down_scale", None),
        )

    def tensors(self, leading: int) -> dict[str, torch.Tensor]:
        """The experts module's parameters and buffers with ``leading`` rows along dim 0."""
        e = self.experts_module
        named = dict(e.named_parameters(recurse=False)) | dict(e.named_buffers(recurse=False))
        for name in ("gate_up_scale", "down_scale"):  # FP8 scales may be plain attributes
            if isinstance(getattr(e, name, None), torch.Tensor):
                named.setdefault(name, getattr(e, name))
        return {n: t for n, t in named.items() if t.dim() > 0 and t.shape[0] == leading}

    def replace_tensors(self, new: dict[str, torch.Tensor]) -> None:
        e = self.experts_module
        for name, tensor in new.items():
            if name in e._parameters:
                e._parameters[name] = nn.Parameter(tensor, requires_grad=False)
            elif name in e._buffers:
                e._buffers[name] = tensor
            else:
                setattr(e, name, tensor)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The main forward's expert-parallel MoE layers, in layer order. A MoE layer whose
    dispatcher does not do expert parallelism (no ``local_logical_experts``: a plugin's that
    ignored ``ParallelConfig.ep_size``) is a ``ValueError``: its sharded experts would be wrong."""
    limit = (getattr(model, "config", None) or {}).get("num_hidden_layers")
    found: dict[int, MoELayer] = {}
    for module in model.modules():
        dispatcher = getattr(module, "dispatcher", None)
        spec = getattr(module, "spec", None)
        if not isinstance(spec, MoESpec) or dispatcher is None or not hasattr(module, "experts"):
            continue
        if limit is not None and spec.layer_index >= limit:
            continue
        if not hasattr(dispatcher, "local_logical_experts"):
            name = getattr(dispatcher, "name", type(dispatcher).__name__)
            raise ValueError(
                f"MoE layer {spec.layer_index}: dispatcher {name!r} does not do expert parallelism "
                "(it has no local_logical_experts); its plugin must decline when ParallelConfig.ep_size > 1"
            )
        found[spec.layer_index] = MoELayer(spec, dispatcher, module)
    return [found[i] for i in sorted(found)]


def keep_local_slots(layers: list[MoELayer]) -> None:
    """Re-make each layer's stacked expert tensors with this rank's slots only (uninitialised:
    the checkpoint fills them through :func:`local_expert_weights`)."""
    for layer in layers:
        spr = layer.dispatcher.slots_per_rank
        tensors = layer.tensors(layer.spec.num_experts)
        layer.replace_tensors(
            {n: torch.empty((spr, *t.shape[1:]), dtype=t.dtype, device=t.device) for n, t in tensors.items()}
        )


def local_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]], layers: list[MoELayer]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each expert-parallel layer's routed experts renumbered to
    this rank's slots (a replicated expert once per slot), the other experts left out."""
    local = {layer.spec.layer_index: (layer.spec.num_experts, layer.dispatcher.local_logical_experts())
             for layer in layers}  # fmt: skip
    for name, tensor in weights:
        per_expert = _PER_EXPERT.match(name)
        if per_expert and int(per_expert["layer"]) in local:
            expert = int(per_expert["expert"])
            for slot, logical in enumerate(local[int(per_expert["layer"])][1]):
                if logical == expert:
                    yield f"{per_expert['pre']}{slot}{per_expert['rest']}", tensor
            continue
        fused = _FUSED.match(name)
        if fused and int(fused["layer"]) in local:
            num_experts, mine = local[int(fused["layer"])]
            if tensor.dim() and tensor.shape[0] == num_experts:
                yield name, tensor[torch.tensor(mine, device=tensor.device)]
                continue
        yield name, tensor


def prepare_rank_model(model: nn.Module) -> Callable | None:
    """What a rank does to its model between construction and loading (``LLMEngine``'s
    ``prepare_model``): keep only its slots; returns the weight-stream filter (None: no
    expert-parallel layer)."""
    layers = moe_layers(model)
    if not layers:
        return None
    keep_local_slots(layers)
    return lambda weights: local_expert_weights(weights, layers)


@torch.inference_mode()
def empty_pass(layers: list[MoELayer], dtype: torch.dtype, device: torch.device) -> None:
    """Every layer's expert exchange with no tokens of our own, in forward order: what a rank
    with nothing to compute runs so that the others' collectives find it."""
    for layer in layers:
        k, d = layer.spec.top_k, layer.spec.hidden_size
        layer.dispatcher.forward(
            layer.spec,
            torch.empty(0, d, dtype=dtype, device=device),
            torch.empty(0, k, dtype=torch.int64, device=device),
            torch.empty(0, k, dtype=torch.float32, device=device),
            layer.weights(),
        )
