"""Building blocks shared by the model architectures (pure torch, shapes in comments)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..moe import MoESpec

if TYPE_CHECKING:
    from ..fused_ops import FusedOps


class RMSNorm(nn.Module):
    fused = None  # a platform's one-kernel version (deepinfer_core.fused_ops), set per module
    fused_add = None  # a platform's residual add + norm in one kernel (FusedOps.add_rms_norm)

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D], a row at a time: batch invariant
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's own op computes the same float32 expression bit for bit, in one call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: a decoder's residual add and the norm after it,
        one kernel where a platform provides it (a decode step is launch-bound), else the same
        two ops."""
        if self.fused_add is not None:
            return self.fused_add(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h

    def use_fused_ops(self, ops: FusedOps) -> bool:
        """Take a platform's one-kernel norm and residual-add norm (``fused_ops.install``)."""
        if ops.rms_norm is None and ops.add_rms_norm is None:
            return False
        self.fused, self.fused_add = ops.rms_norm, ops.add_rms_norm
        return True


class FusedLinear(nn.Linear):
    """Several projections of the same input computed by one matmul (fewer, larger GEMMs).

    Checkpoints store the projections separately (``q_proj``, ``k_proj``...): ``parts`` maps each
    of those names to its rows of the fused weight, and :func:`fused_targets` tells a loader
    where each separate tensor goes."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts: dict[str, slice] = {}
        start = 0
        for name, rows in parts.items():
            self.parts[name] = slice(start, start + rows)
            start += rows

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [T, sum] -> one [T, rows] per part
        return tuple(out[..., sl] for sl in self.parts.values())

    def checkpoint_slots(self, name: str) -> tuple[dict[str, torch.Tensor], set[str]]:
        """``(each part's checkpoint name -> its rows of the fused parameter, the fused parameter
        names)`` for this module under ``name`` (see :func:`fused_targets`)."""
        prefix = name.rpartition(".")[0]
        prefix = f"{prefix}." if prefix else ""
        targets: dict[str, torch.Tensor] = {}
        fused: set[str] = set()
        for param_name in ("weight", "bias"):
            param = getattr(self, param_name)
            if param is None:
                continue
            fused.add(f"{name}.{param_name}")
            for part, rows in self.parts.items():
                targets[f"{prefix}{part}.{param_name}"] = param.data[rows]
        return targets, fused


def fused_targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``(checkpoint name -> view of the parameter or buffer it fills, names of the parameters and
    buffers no checkpoint has)`` for every module of ``model`` that lays out its checkpoint tensors
    itself: each answers ``checkpoint_slots(name)`` (:class:`FusedLinear`, the FP8 modules of
    ``models.fp8``, the modules a weight format swaps in: :mod:`deepinfer_core.weight_format`), so
    this module imports none of them."""
    targets: dict[str, torch.Tensor] = {}
    own: set[str] = set()
    for module_name, module in model.named_modules():
        claim = getattr(module, "checkpoint_slots", None)
        if claim is not None:
            more, more_own = claim(module_name)
            targets |= more
            own |= more_own
    return targets, own


def plain_linear(module: nn.Module | None) -> bool:
    """A bias-free ``nn.Linear`` (or :class:`FusedLinear`) computing ``x @ weight^T`` as torch's
    does: what a platform's ``FusedOps.dense_linear`` may run instead (not FP8 / low-bit modules)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward and module.bias is None


def project(linear, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, through ``linear`` (``FusedOps.dense_linear``, set by fused_ops.install)
    when there is one and the module is a :func:`plain_linear`."""
    if linear is not None and plain_linear(module):
        return linear(x, module.weight)
    return module(x)


class GatedMLP(nn.Module):
    """SwiGLU MLP; gate and up projections fused, loaded from Hugging Face's separate
    ``gate_proj`` / ``up_proj`` tensors (see :func:`fused_targets`)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:  # bias: Llama's mlp_bias
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate}, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    fused_act = None  # a platform's one-kernel silu(gate) * up (deepinfer_core.fused_ops)
    linear = None  # a platform's FusedOps.dense_linear for the two projections (fused_ops.install)

    def use_fused_ops(self, ops: FusedOps) -> bool:
        """Take ``ops.dense_linear`` for both projections and ``ops.silu_and_mul`` for the
        activation (where gate and up are fused in that order); ``fused_ops.install`` calls it."""
        if ops.dense_linear is not None:
            self.linear = ops.dense_linear
        gate_then_up = list(getattr(self.gate_up_proj, "parts", {})) == ["gate_proj", "up_proj"]
        fuses_act = ops.silu_and_mul is not None and gate_then_up
        if fuses_act:
            self.fused_act = ops.silu_and_mul
        return fuses_act or ops.dense_linear is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        if self.fused_act is not None:
            return project(self.linear, self.down_proj, self.fused_act(project(self.linear, self.gate_up_proj, x)))
        gate, up = self.gate_up_proj.split(project(self.linear, self.gate_up_proj, x))
        return project(self.linear, self.down_proj, F.silu(gate) * up)


class StackedExperts(nn.Module):
    """Routed experts stacked along dim 0, named like transformers 5's fused layout."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        E, I, D = spec.num_experts, spec.intermediate_size, spec.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))  # gate rows, then up rows
        self.down_proj = nn.Parameter(torch.empty(E, D, I))


def rope_inv_freq(
    dim: int, theta: float, scaling: dict | None = None, max_position_embeddings: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the attention scaling factor for a rope config.

    Supports the "default", "linear" (positions divided by ``factor``), "llama3", "freq_factors"
    (a GGUF's ``rope_freqs`` divisors, as llama.cpp's converter writes llama3 scaling) and "yarn"
    (:func:`yarn_rope_inv_freq`; needs ``max_position_embeddings`` where the config gives no
    ``factor``) rope types; other types (e.g. "dynamic", whose frequencies change with the
    sequence length) raise so a model never runs with silently wrong positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq.float(), 1.0
    if rope_type == "linear":  # transformers: the float32 frequencies divided by the factor
        return inv_freq.float() / float(scaling["factor"]), 1.0
    if rope_type == "yarn":
        if scaling.get("factor") is None and max_position_embeddings is None:
            raise ValueError("yarn rope scaling without a factor needs max_position_embeddings")
        return yarn_rope_inv_freq(dim, theta, scaling, max_position_embeddings or 0)
    if rope_type == "freq_factors":  # a GGUF's rope_freqs tensor (llama.cpp): each frequency divided by its factor
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{factors.numel()} rope frequency factors for {inv_freq.numel()} rotary frequencies")
        return (inv_freq / factors).float(), 1.0
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        return scaled.float(), 1.0
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported here")


class PreNormDecoderLayer(nn.Module):
    """A pre-norm decoder layer (Llama, DeepSeek-V3): subclasses build ``input_layernorm``,
    ``self_attn``, ``post_attention_layernorm`` and ``mlp``; the residual wiring is shared."""

    def forward(self, h, positions, rotary, kv_cache, meta) -> torch.Tensor:  # h [T, D]
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_residual(self, h, residual, positions, rotary, kv_cache, meta):
        """:meth:`forward` with the residual stream kept apart (``residual`` None: ``h`` is the
        embeddings), so each residual add meets the next norm in one fused kernel; returns
        (MLP output, residual), whose sum is ``forward``'s result, bit for bit."""
        x, residual = (
            (self.input_layernorm(h), h) if residual is None else self.input_layernorm.add_forward(h, residual)
        )
        x, residual = self.post_attention_layernorm.add_forward(
            self.self_attn(x, positions, rotary, kv_cache, meta), residual
        )
        return self.mlp(x), residual


class Rotary(nn.Module):
    """cos/sin tables indexed by absolute position; applied in the rotate-half (NeoX) layout."""

    fused = None  # a platform's one-kernel rotation (FusedOps.rotary), handed to each RotaryAt

    def __init__(self, dim: int, max_positions: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, dim]
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [T, H, dim]
        return self.at(positions, x.dtype)(x)

    def use_fused_ops(self, ops: FusedOps) -> bool:
        """Take a platform's one-kernel rotation (``fused_ops.install``)."""
        if ops.rotary is None:
            return False
        self.fused = ops.rotary
        return True

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryAt":
        """The tables looked up once for a step's positions, so that every layer (and q and k
        together) reuses them instead of indexing them again (fewer ops per decode step)."""
        return RotaryAt(
            self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype), self.fused
        )


@dataclass(frozen=True)
class RotaryAt:
    """Rotary embedding at fixed positions: ``cos``/``sin`` [T, 1, dim]; rotate-half layout."""

    cos: torch.Tensor
    sin: torch.Tensor
    fused: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # FusedOps.rotary

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H, dim], any number of heads
        if self.fused is not None:
            return self.fused(x, self.cos, self.sin)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin


# -- YaRN (DeepSeek-V2/V3 long-context rope) ------------------------------------------------------


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context-extension ``factor`` (1.0 when not extending)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def yarn_rope_inv_freq(
    dim: int, theta: float, scaling: dict, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and cos/sin scaling for the "yarn" rope type.

    Frequencies whose wavelength fits the original context many times (high frequency) are
    kept; those that never completed a rotation there (low frequency) are divided by ``factor``;
    a linear ramp blends between the ``beta_fast`` / ``beta_slow`` rotation counts. Computed in
    float32 on purpose: that is how Hugging Face builds the table, and the long-context logits we
    compare against depend on those exact bits."""
    orig_ctx = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / orig_ctx
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # dimension index completing `rotations` turns
        return dim * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 -> original frequency, 0 -> interpolated
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)
