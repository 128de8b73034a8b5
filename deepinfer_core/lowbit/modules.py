"""Modules that hold packed weights in place of ``nn.Linear`` / ``nn.Embedding``.

:func:`swap_in_lowbit` replaces, before weights are loaded, each linear layer (fused or not)
whose checkpoint tensors are all block-quantized, and the token embedding if it is. The
model's ``load_weights`` then finds, through :func:`lowbit_targets`, a :class:`WeightSlot` per
checkpoint name and hands it the packed tensor; no float copy of those weights ever exists.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import ops
from .formats import QK, QuantWeight, quantize_q8


class WeightSlot:
    """Where one checkpoint tensor of a low-bit module goes (duck-types a parameter's shape)."""

    def __init__(self, module: "LowBitLinear | LowBitEmbedding", part: str, shape: tuple[int, int]) -> None:
        self.module, self.part, self.shape = module, part, torch.Size(shape)

    def fill(self, weight: "QuantWeight | torch.Tensor") -> None:
        if isinstance(weight, torch.Tensor):  # a float tensor in a quantized file: pack it too
            weight = quantize_q8(weight)
        self.module.fill(self.part, weight)


class LowBitLinear(nn.Module):
    """``y = x @ W^T (+ b)`` with W packed; ``parts`` / ``split`` as :class:`FusedLinear`'s.

    Parts of different formats (a Q4_K file often stores V or down in Q6_K) stay separate
    segments, multiplied one after the other."""

    def __init__(self, in_features: int, parts: dict[str, slice], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = dict(parts)
        self.out_features = max(sl.stop for sl in parts.values())
        self.bias = (
            None
            if bias is None
            else nn.Parameter(torch.empty(self.out_features, dtype=torch.float32), requires_grad=False)
        )
        self._pending: dict[str, QuantWeight] = {}
        self.segments: list[QuantWeight] = []
        self.int_rows = ops.int_rows()  # calls with at most this many rows use the integer kernel
        self.int8_rows = ops.int8_rows()  # 4-bit segments: calls from this many rows use int8 activations

    def fill(self, part: str, weight: QuantWeight) -> None:
        self._pending[part] = weight
        if len(self._pending) == len(self.parts):  # all parts in: build the segments, in row order
            ordered = [self._pending[p] for p in sorted(self.parts, key=lambda p: self.parts[p].start)]
            self.segments = _merge_same_kind(ordered)
            self._pending = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        # The common case (float32 [T, K], one segment) dispatches nothing but the kernel call:
        # on a one-token decode step every skipped no-op conversion is host time saved.
        flat = x.dim() == 2 and x.dtype == torch.float32
        a = x if flat else x.reshape(-1, self.in_features).float()
        if len(self.segments) == 1:
            y = ops.matmul(a, self.segments[0], self.int_rows, self.int8_rows)
        else:
            y = torch.cat([ops.matmul(a, w, self.int_rows, self.int8_rows) for w in self.segments], dim=-1)
        if self.bias is not None:
            y += self.bias
        return y if flat else y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    project = forward  # as an output head

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out[..., sl] for sl in self.parts.values())

    def extra_repr(self) -> str:
        kinds = "+".join(f"{w.kind}<{w.source}>" for w in self.segments)
        return f"in={self.in_features}, out={self.out_features}, {kinds or 'empty'}"


class LowBitEmbedding(nn.Module):
    """Token embedding kept packed: a lookup dequantizes only the requested rows; as a tied
    output head it multiplies through the kernels."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.in_features = num_embeddings, dim
        self.weight_q: QuantWeight | None = None
        self.int_rows = ops.int_rows()
        self.int8_rows = ops.int8_rows()

    def fill(self, part: str, weight: QuantWeight) -> None:
        self.weight_q = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D] float32
        return self.weight_q.dequantize(ids)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V]
        return ops.matmul(hidden, self.weight_q, self.int_rows, self.int8_rows)


def use_exact_kernels(model: nn.Module) -> int:
    """Put every low-bit module of ``model`` on the exact float32 kernel (a batch-invariant
    engine: the integer kernels are taken by row count, so a row's result would depend on the
    batch). Returns how many modules changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, (LowBitLinear, LowBitEmbedding)) and (module.int_rows or module.int8_rows):
            module.int_rows = module.int8_rows = 0
            changed += 1
    return changed


def _merge_same_kind(weights: list[QuantWeight]) -> list[QuantWeight]:
    merged: list[QuantWeight] = []
    for w in weights:
        if merged and merged[-1].kind == w.kind:
            last = merged[-1]
            m = None if w.m is None else torch.cat([last.m, w.m])
            source = (
                last.source if w.source in last.source.split("+") else f"{last.source}+{w.source}"
            )  # e.g. q5<Q5_0+Q5_1>
            merged[-1] = QuantWeight(w.kind, torch.cat([last.qs, w.qs]), torch.cat([last.d, w.d]), m, source)
        else:
            merged.append(w)
    return [
        QuantWeight(w.kind, w.qs.contiguous(), w.d.contiguous(), None if w.m is None else w.m.contiguous(), w.source)
        for w in merged
    ]


def swap_in_lowbit(model: nn.Module, quantized: set[str]) -> int:
    """Replace every ``nn.Linear`` (fused or not) whose checkpoint weights are all in
    ``quantized`` and whose input width is a multiple of 32, and a quantized ``embed_tokens``.
    Returns how many modules were replaced."""
    replaced = 0
    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        prefix = f"{parent_name}." if parent_name else ""
        new: nn.Module | None = None
        if isinstance(module, nn.Linear) and module.in_features % QK == 0:
            parts = getattr(module, "parts", None) or {attr: slice(0, module.out_features)}
            if all(f"{prefix}{p}.weight" in quantized for p in parts):
                new = LowBitLinear(module.in_features, parts, module.bias)
        elif isinstance(module, nn.Embedding) and attr == "embed_tokens" and f"{name}.weight" in quantized:
            if module.embedding_dim % QK == 0:
                new = LowBitEmbedding(module.num_embeddings, module.embedding_dim)
        if new is not None:
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
            replaced += 1
    return replaced


def lowbit_targets(model: nn.Module) -> tuple[dict[str, "WeightSlot | torch.Tensor"], set[str]]:
    """``(checkpoint name -> slot or bias view, the modules' own parameter names)``, the
    counterpart of :func:`deepinfer_core.models.layers.fused_targets` for low-bit modules."""
    targets: dict[str, WeightSlot | torch.Tensor] = {}
    own: set[str] = set()
    for name, module in model.named_modules():
        parent_name = name.rpartition(".")[0]
        prefix = f"{parent_name}." if parent_name else ""
        if isinstance(module, LowBitEmbedding):
            targets[f"{name}.weight"] = WeightSlot(module, "weight", (module.num_embeddings, module.in_features))
        elif isinstance(module, LowBitLinear):
            for part, rows in module.parts.items():
                targets[f"{prefix}{part}.weight"] = WeightSlot(
                    module, part, (rows.stop - rows.start, module.in_features)
                )
                if module.bias is not None:
                    targets[f"{prefix}{part}.bias"] = module.bias.data[rows]
            if module.bias is not None:
                own.add(f"{name}.bias")
    return targets, own
