"""MXFP4 routed experts kept packed (DeepSeek-V4's released checkpoint format).

DeepSeek ships V4's routed experts as MXFP4: two e2m1 values a byte and one UE8M0 scale per 32
inputs (:mod:`deepinfer_core.quant`), 4.25 bits a weight. Dequantized at load they take 16 bits
(bf16) or 32 (float32) a weight: ~3.8x / ~7.5x the bytes of the experts, most of a V4's memory.
Where a platform runs the experts on the packed bytes (``FusedOps.mxfp4_moe``), the engine keeps
them: :func:`swap_in_mxfp4` replaces, before loading, each routed-expert stack whose checkpoint
weights are all MXFP4 by :class:`Mxfp4Experts`, whose ``checkpoint_slots`` tell the loader where
each per-expert tensor goes (``layers.fused_targets``).

What is held, per layer (E experts, hidden D, expert width I), all uint8 buffers (so the
engine's ``model.to(dtype)`` leaves them alone)::

    qgate_up        [E, 2I, D/2]   gate rows, then up rows; byte = code(2j) | code(2j+1) << 4
    qdown           [E, D, I/2]
    qgate_up_scale  [E, 2I, D/32]  UE8M0 exponent b: the group's values times 2^(b - 127)
    qdown_scale     [E, D, I/32]

The MoE dispatcher receives them in :class:`~deepinfer_core.moe.ExpertWeights` (uint8 weights
mean MXFP4); one that cannot run them widens them per call (``ExpertWeights.dequantized``, the
reference: the same numbers as dequantizing at load).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..quant import FP4_GROUP
from .fp8 import PackedExperts

__all__ = ["Mxfp4Experts", "swap_in_mxfp4"]

_PROJS = ("gate_proj", "up_proj", "down_proj")


class Mxfp4Experts(PackedExperts):
    """Routed experts stacked like ``StackedExperts``, kept MXFP4 (layout in the module docstring);
    ``gate_up_proj`` / ``down_proj`` / ``gate_up_scale`` / ``down_scale`` are the packed buffers,
    as :class:`~deepinfer_core.moe.ExpertWeights` takes them."""

    def __init__(self, num_experts: int, intermediate: int, hidden: int) -> None:
        super().__init__()
        E, I, D = num_experts, intermediate, hidden
        if D % FP4_GROUP or I % FP4_GROUP:
            raise ValueError(f"MXFP4 experts need hidden ({D}) and width ({I}) multiples of {FP4_GROUP}")
        self.register_buffer("qgate_up", torch.empty(E, 2 * I, D // 2, dtype=torch.uint8))
        self.register_buffer("qdown", torch.empty(E, D, I // 2, dtype=torch.uint8))
        self.register_buffer("qgate_up_scale", torch.empty(E, 2 * I, D // FP4_GROUP, dtype=torch.uint8))
        self.register_buffer("qdown_scale", torch.empty(E, D, I // FP4_GROUP, dtype=torch.uint8))

    gate_up_proj = property(lambda self: self.qgate_up)
    down_proj = property(lambda self: self.qdown)
    gate_up_scale = property(lambda self: self.qgate_up_scale)
    down_scale = property(lambda self: self.qdown_scale)

    def extra_repr(self) -> str:
        E, two_i, half_d = self.qgate_up.shape
        return f"experts={E}, width={two_i // 2}, hidden={2 * half_d}, mxfp4 e2m1 + ue8m0 per 32"


def swap_in_mxfp4(model: nn.Module, mxfp4_names: frozenset[str] | set[str]) -> set[str]:
    """Replace each routed-expert stack (a module with ``gate_up_proj [E, 2I, D]`` and
    ``down_proj [E, D, I]`` parameters, named ``...mlp.experts``) whose per-expert checkpoint
    weights are all MXFP4 (``mxfp4_names``: ``...experts.N.{gate,up,down}_proj.weight``) by
    :class:`Mxfp4Experts`, on the device of the weights it replaces. Returns the checkpoint
    weight names now kept packed (the loader dequantizes every other quantized tensor)."""
    kept: set[str] = set()
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        gate_up = module._parameters.get("gate_up_proj") if attr == "experts" else None
        down = module._parameters.get("down_proj") if gate_up is not None else None
        if gate_up is None or down is None or gate_up.dim() != 3:
            continue
        E, two_i, D = gate_up.shape
        names = {f"{name}.{e}.{p}.weight" for e in range(E) for p in _PROJS}
        if not names <= mxfp4_names or D % FP4_GROUP or (two_i // 2) % FP4_GROUP:
            continue
        with torch.device(gate_up.device):  # the packed bytes go where the weights were
            new = Mxfp4Experts(E, two_i // 2, D)
        setattr(model.get_submodule(parent_name), attr, new)
        kept |= names
    return kept
