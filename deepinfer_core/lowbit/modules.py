"""Modules that hold packed weights in place of ``nn.Linear`` / ``nn.Embedding``.

The low-bit weight format (``deepinfer_core.builtin.lowbit``) swaps them into a model before its
weights load. The model's ``load_weights`` then finds, through each module's
``checkpoint_slots`` (the weight-format contract, :mod:`deepinfer_core.weight_format`), a
:class:`WeightSlot` per checkpoint name and hands it the packed tensor; no float copy of those
weights ever exists. As an LM head they multiply through the kernels (``project``) and answer
greedy rows without the logits (``greedy_argmax``, head.c / head_screen.c).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import ops
from .formats import QuantWeight, quantize_q8


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

    def checkpoint_slots(self, name: str) -> tuple[dict[str, "WeightSlot | torch.Tensor"], set[str]]:
        """``(checkpoint name -> slot or bias view, this module's own parameter names)``."""
        parent = name.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        targets: dict[str, WeightSlot | torch.Tensor] = {}
        for part, rows in self.parts.items():
            targets[f"{prefix}{part}.weight"] = WeightSlot(self, part, (rows.stop - rows.start, self.in_features))
            if self.bias is not None:
                targets[f"{prefix}{part}.bias"] = self.bias.data[rows]
        return targets, ({f"{name}.bias"} if self.bias is not None else set())

    def greedy_argmax(
        self, hidden: torch.Tensor, threads: int, screened: bool = True
    ) -> "tuple[torch.Tensor, int] | None":
        """As an LM head: :func:`greedy_argmax` (one format, no bias), else None."""
        if len(self.segments) != 1 or self.bias is not None:
            return None
        return greedy_argmax(self, self.segments[0], hidden, threads, screened)

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

    def checkpoint_slots(self, name: str) -> tuple[dict[str, "WeightSlot"], set[str]]:
        return {f"{name}.weight": WeightSlot(self, "weight", (self.num_embeddings, self.in_features))}, set()

    def greedy_argmax(
        self, hidden: torch.Tensor, threads: int, screened: bool = True
    ) -> "tuple[torch.Tensor, int] | None":
        """As a tied LM head: :func:`greedy_argmax`."""
        if self.weight_q is None:
            return None
        return greedy_argmax(self, self.weight_q, hidden, threads, screened)


def greedy_argmax(
    head: nn.Module, w: QuantWeight, hidden: torch.Tensor, threads: int, screened: bool
) -> tuple[torch.Tensor, int] | None:  # [N, D] -> ([N] int64, vocab)
    """``torch.argmax(head.project(hidden), -1)`` and the vocabulary size, without the [N, V]
    logits (head.c: the same kernel and bits, ties to the lowest index); None for a NaN logit.
    ``screened``: from ops.SCREEN_MIN_ROWS rows on, a q8 head may be screened in int8 (same
    indices, less work), the screen built on first use (an engine that never steps that many
    rows never holds its 37 MiB for SmolLM2) and kept on ``head`` with the weight it came from."""
    screen = _head_screen(head, w) if screened and hidden.shape[0] >= ops.SCREEN_MIN_ROWS else None
    tokens = ops.head_argmax(hidden, w, head.int_rows, head.int8_rows, threads, screen)
    return None if tokens is None else (tokens, w.qs.shape[0])


def _head_screen(head: nn.Module, w: QuantWeight) -> "ops.HeadScreen | None":
    if not ops.screen_pays():
        return None
    cached = head.__dict__.get("_head_screen")
    if cached is None or cached[0] is not w.qs:
        cached = (w.qs, ops.prepare_screen(w))
        head.__dict__["_head_screen"] = cached
    return cached[1]


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
