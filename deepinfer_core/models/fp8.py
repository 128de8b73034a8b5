"""FP8 block-scaled weights kept as FP8 (DeepSeek-V3's released checkpoint format).

DeepSeek ships V3 with every projection as ``float8_e4m3fn`` ``weight`` plus a float32
``weight_scale_inv`` holding one "multiply" scale per 128 x 128 tile. Dequantizing them at load
doubles the bytes every decode step reads; where a platform has a kernel for them
(``FusedOps.fp8_linear`` and an MoE dispatcher that takes :class:`ExpertWeights` scales), the
engine keeps them as they are: :func:`swap_in_fp8` replaces, before loading, each linear layer
and routed-expert stack whose checkpoint tensors are all FP8 by a module holding the FP8 bytes
and the scale grid, and each module's ``checkpoint_slots`` tells the loader where each checkpoint
tensor goes (through ``layers.fused_targets``).

The modules keep the bytes in integer buffers (uint8 weight, int32 scale bits) viewed as
float8 / float32 when used, so the engine's ``model.to(dtype)`` cannot widen them. Without a
kernel a module dequantizes on the fly: the same numbers as dequantizing at load (float32 tile
products rounded once to the activation dtype).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import FusedLinear, StackedExperts

if TYPE_CHECKING:
    from ..fused_ops import FusedOps

FP8_BLOCK = 128
# MLA views kv_b_proj's weight per head as W_UK / W_UV (deepseek_v3_mla): that one stays dense.
DENSE_ONLY = ("kv_b_proj",)


def _grid(n: int) -> int:
    return -(-n // FP8_BLOCK)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float8 ``[.., N, K]`` x ``[.., ceil(N/128), ceil(K/128)]`` scales -> float32."""
    from ..quant import dequant_fp8_block

    return dequant_fp8_block(weight, scale_inv)


class Fp8Linear(nn.Module):
    """``y = x @ dequant(W)^T`` with W kept FP8; ``parts`` / ``split`` as ``FusedLinear``'s
    (each part starting on a 128-row tile, so every part's scale rows are its own)."""

    kernel = None  # a platform's (x, weight float8 [N, K], scale_inv [N/128, K/128]) -> y

    def __init__(self, in_features: int, out_features: int, parts: dict[str, slice] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts = dict(parts) if parts else {}
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("qscale", torch.empty(_grid(out_features), _grid(in_features), dtype=torch.int32))

    @property
    def weight_fp8(self) -> torch.Tensor:
        return self.qweight.view(torch.float8_e4m3fn)

    @property
    def scale_inv(self) -> torch.Tensor:
        return self.qscale.view(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight_fp8, self.scale_inv)
        return F.linear(x, dequantize(self.weight_fp8, self.scale_inv).to(x.dtype))

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out[..., sl] for sl in self.parts.values())

    def checkpoint_slots(self, name: str) -> tuple[dict[str, torch.Tensor], set[str]]:
        """``(checkpoint name -> view the tensor is copied into, buffer names no checkpoint has)``:
        the weight and its scale grid, or each part's rows of them (``layers.fused_targets``);
        copying float values into an FP8 view stores their FP8 bytes (exact for values that came
        from FP8)."""
        own = {f"{name}.qweight", f"{name}.qscale"}
        weight, scale = self.weight_fp8, self.scale_inv
        if not self.parts:
            return {f"{name}.weight": weight, f"{name}.weight_scale_inv": scale}, own
        prefix = name.rpartition(".")[0]
        prefix = f"{prefix}." if prefix else ""
        targets = {}
        for part, rows in self.parts.items():
            targets[f"{prefix}{part}.weight"] = weight[rows]
            targets[f"{prefix}{part}.weight_scale_inv"] = scale[rows.start // FP8_BLOCK : _grid(rows.stop)]
        return targets, own

    def use_fused_ops(self, ops: FusedOps) -> bool:
        """Take a platform's FP8 GEMM (``fused_ops.install``)."""
        if ops.fp8_linear is None:
            return False
        self.kernel = ops.fp8_linear
        return True

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3 128x128 blocks"


class PackedExperts(nn.Module):
    """Routed experts kept in a checkpoint's quantized format in four integer buffers
    (``qgate_up``, ``qdown`` and their scales), seen as ``gate_up_proj`` / ``down_proj`` /
    ``gate_up_scale`` / ``down_scale`` (properties of each subclass: FP8 here, MXFP4 in
    ``models.mxfp4``)."""

    def checkpoint_slots(self, name: str) -> tuple[dict[str, torch.Tensor], set[str]]:
        """The stacked weights and their scales under their checkpoint names (the per-expert
        pieces fill their rows: ``hf_weights._expert_slice``), and the integer buffers holding
        them (``layers.fused_targets``)."""
        own = {f"{name}.{b}" for b in ("qgate_up", "qdown", "qgate_up_scale", "qdown_scale")}
        return {
            f"{name}.gate_up_proj": self.gate_up_proj,
            f"{name}.down_proj": self.down_proj,
            f"{name}.gate_up_proj_scale_inv": self.gate_up_scale,
            f"{name}.down_proj_scale_inv": self.down_scale,
        }, own


class Fp8Experts(PackedExperts):
    """Routed experts stacked like ``StackedExperts`` (``gate_up_proj [E, 2I, D]``,
    ``down_proj [E, D, I]``), kept FP8 with their scale grids (``gate_up_scale``, ``down_scale``)."""

    def __init__(self, num_experts: int, intermediate: int, hidden: int) -> None:
        super().__init__()
        E, I, D = num_experts, intermediate, hidden
        self.register_buffer("qgate_up", torch.empty(E, 2 * I, D, dtype=torch.uint8))
        self.register_buffer("qdown", torch.empty(E, D, I, dtype=torch.uint8))
        self.register_buffer("qgate_up_scale", torch.empty(E, _grid(2 * I), _grid(D), dtype=torch.int32))
        self.register_buffer("qdown_scale", torch.empty(E, _grid(D), _grid(I), dtype=torch.int32))

    gate_up_proj = property(lambda self: self.qgate_up.view(torch.float8_e4m3fn))
    down_proj = property(lambda self: self.qdown.view(torch.float8_e4m3fn))
    gate_up_scale = property(lambda self: self.qgate_up_scale.view(torch.float32))
    down_scale = property(lambda self: self.qdown_scale.view(torch.float32))


def swap_in_fp8(model: nn.Module, fp8_names: frozenset[str] | set[str]) -> set[str]:
    """Replace each linear layer (fused or not) and routed-expert stack whose checkpoint weights
    are all FP8 (``fp8_names``: ``X.weight`` names that come with ``X.weight_scale_inv``) by its
    FP8 module, on the device of the parameter it replaces. Returns the checkpoint weight names
    now kept FP8 (the loader dequantizes every other FP8 tensor)."""
    kept: set[str] = set()
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        prefix = f"{parent_name}." if parent_name else ""
        if attr in DENSE_ONLY or not name:
            continue
        make = None
        if isinstance(module, FusedLinear) and module.bias is None:
            names = {f"{prefix}{p}.weight" for p in module.parts}
            aligned = all(sl.start % FP8_BLOCK == 0 for sl in module.parts.values())
            if aligned and names <= fp8_names:
                make = lambda m=module: Fp8Linear(m.in_features, m.out_features, m.parts)  # noqa: E731
        elif type(module) is nn.Linear and module.bias is None and f"{name}.weight" in fp8_names:
            names = {f"{name}.weight"}
            make = lambda m=module: Fp8Linear(m.in_features, m.out_features)  # noqa: E731
        elif isinstance(module, StackedExperts):
            E, two_i, D = module.gate_up_proj.shape
            names = {f"{name}.{e}.{p}.weight" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
            if (two_i // 2) % FP8_BLOCK == 0 and names <= fp8_names:
                make = lambda E=E, i=two_i // 2, D=D: Fp8Experts(E, i, D)  # noqa: E731
        if make is None:
            continue
        with torch.device(next(module.parameters()).device):  # the FP8 bytes go where the weight was
            new = make()
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        kept |= names
    return kept
