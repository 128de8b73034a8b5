"""DeepSeek-V4 building blocks on a flat token batch: norms, interleaved partial RoPE,
hyper-connections (mHC with Sinkhorn), the grouped low-rank output projection and the MoE block.

Each mirrors transformers' ``modeling_deepseek_v4`` operation for operation (same op order and
float32 islands), because the acceptance bar is logits within 1e-4 of it; shapes drop the batch
axis (``[T, ...]`` instead of ``[B, S, ...]``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...moe import ExpertWeights, MoEDispatcher, MoESpec
from ..layers import FusedLinear, yarn_rope_inv_freq
from ..shared_expert import SharedExpertFold
from .config import V4Config

if TYPE_CHECKING:
    from ...fused_ops import FusedOps

# Kept in float32 whatever the model dtype: transformers' ``_keep_in_fp32_modules_strict`` for
# DeepSeek-V4 (mHC mixing, sinks, compressor position biases, router bias, every RMSNorm weight),
# plus the MTP block's own norms, whose weights DeepSeek's code also holds in float32. Matched
# as whole components of a parameter's dotted name, as transformers matches them.
FLOAT32_MODULES = (
    "attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm", "kv_norm",
    "input_layernorm", "post_attention_layernorm", "norm", "enorm", "hnorm",
)  # fmt: skip


def keep_float32(module: nn.Module, names=FLOAT32_MODULES) -> None:
    """Cast back to float32 the parameters and buffers a ``module.to(dtype)`` narrowed."""
    pattern = re.compile("|".join(rf"(^|\.){re.escape(n)}($|\.)" for n in names))
    for name, sub in module.named_modules():
        for store in (sub._parameters, sub._buffers):
            for leaf, t in store.items():
                if t is not None and t.is_floating_point() and pattern.search(f"{name}.{leaf}" if name else leaf):
                    if isinstance(t, nn.Parameter):
                        t.data = t.data.float()
                    else:
                        store[leaf] = t.float()


class V4RMSNorm(nn.Module):
    """Weighted RMSNorm; weight kept in float32 and applied before the cast back."""

    fused = None  # a platform's one-kernel version (FusedOps.v4_rms_norm), set by fused_ops.install

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)

    def use_fused_ops(self, ops: FusedOps) -> bool:
        """Take a platform's one-kernel V4 norm (``fused_ops.install``)."""
        if ops.v4_rms_norm is None:
            return False
        self.fused = ops.v4_rms_norm
        return True


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4Rope:
    """Interleaved RoPE on the trailing ``rope_dim`` channels of each head (pairs (0,1),(2,3)...).
    cos/sin are computed per call from positions, like the reference (no table to keep)."""

    def __init__(self, rope_dim: int, params: dict, max_positions: int, device=None) -> None:
        theta = params["rope_theta"]
        if params["rope_type"] == "yarn":
            inv_freq, scale = yarn_rope_inv_freq(rope_dim, theta, params, max_positions)
        else:
            inv_freq, scale = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)), 1.0
        self.inv_freq = inv_freq.float().to(device)
        self.scale = scale
        self.rope_dim = rope_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [T, rope/2]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    def cos_neg_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, -sin)``: the inverse rotation (attention's output, un-roped at the query)."""
        cos, sin = self.cos_sin(positions, dtype)
        return cos, -sin

    def window_cos_sin(self, positions: torch.Tensor, ratio: int, dtype: torch.dtype):
        """cos/sin at the first position of each position's ``ratio``-wide window (where a
        compressor ropes the entry that window makes)."""
        return self.cos_sin(torch.div(positions, ratio, rounding_mode="floor") * ratio, dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H, D] (or [T, D] with cos [T, r/2] broadcast per head)."""
        cos = cos.repeat_interleave(2, dim=-1)
        sin = sin.repeat_interleave(2, dim=-1)
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        r = cos.shape[-1]
        nope, rope = x[..., :-r], x[..., -r:]
        rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
        out = (rope.float() * cos + rotated.float() * sin).to(x.dtype)
        return torch.cat([nope, out], dim=-1)


class StepRope:
    """One forward's view of a :class:`V4Rope`: each cos/sin pair is computed once per positions
    tensor (and window ratio) and reused by every layer and compressor of that forward, instead
    of ~8 small kernels in each of them (a decode step of V4-mini: 14 pairs down to 4). Keyed
    by the positions tensor itself (held, so its id cannot be reused while the view lives);
    made per forward by :func:`step_ropes` and dropped with it, so nothing outlives the step's
    tensors. The values are the ones :class:`V4Rope` computes, bit for bit."""

    def __init__(self, rope: V4Rope) -> None:
        self.rope = rope
        self._memo: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _get(self, key: tuple, positions: torch.Tensor, compute) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._memo.get(key)
        if hit is None or hit[0] is not positions:
            hit = self._memo[key] = (positions, *compute())
        return hit[1], hit[2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._get((id(positions), dtype), positions, lambda: self.rope.cos_sin(positions, dtype))

    def cos_neg_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, -sin)``: the inverse rotation (attention's output, un-roped at the query)."""
        return self._get(("neg", id(positions), dtype), positions, lambda: self._neg(positions, dtype))

    def _neg(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, dtype)
        return cos, -sin

    def window_cos_sin(self, positions: torch.Tensor, ratio: int, dtype: torch.dtype):
        return self._get(
            (id(positions), ratio, dtype), positions, lambda: self.rope.window_cos_sin(positions, ratio, dtype)
        )

    apply = staticmethod(V4Rope.apply)


def step_ropes(ropes: dict[str, V4Rope]) -> dict[str, StepRope]:
    """The per-forward views (:class:`StepRope`) of a model's ropes."""
    return {name: StepRope(rope) for name, rope in ropes.items()}


class HyperConnection(nn.Module):
    """mHC weights from the ``hc_mult`` streams: pre (collapse), post (expand), comb (mix,
    Sinkhorn-projected towards doubly stochastic). Parameters ``fn``, ``base``, ``scale``."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        hc = cfg.hc_mult
        self.hc, self.iters, self.eps, self.norm_eps = hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + hc) * hc, hc * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + hc) * hc))
        self.scale = nn.Parameter(torch.empty(3))
        self.fused_mix = None  # FusedOps.hc_mix (one kernel for hc_mix_reference), set by fused_ops.install
        self.fused_merge = None  # FusedOps.hc_merge (one kernel for hc_merge), set by fused_ops.install
        self.fused_norm = None  # FusedOps.v4_unweighted_rms_norm (one kernel for unweighted_rms_norm), likewise
        self.fused_pre = None  # FusedOps.hc_pre (this whole forward, may decline), likewise

    def forward(self, streams: torch.Tensor):  # [T, hc, D] -> post [T, hc], comb [T, hc, hc], collapsed [T, D]
        if self.fused_pre is not None:
            out = self.fused_pre(streams, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps)
            if out is not None:
                return out
        flat = (self.fused_norm or unweighted_rms_norm)(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        mix = self.fused_mix if self.fused_mix is not None else hc_mix_reference
        return mix(mixed, self.base, self.scale, streams, self.iters, self.eps)

    def merge(self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """:func:`hc_merge` (through the platform's kernel where installed)."""
        return (self.fused_merge if self.fused_merge is not None else hc_merge)(streams, out, post, comb)

    def use_fused_ops(self, ops: FusedOps) -> bool:
        """Take a platform's hyper-connection kernels (``fused_ops.install``)."""
        if ops.hc_mix is None and ops.hc_merge is None and ops.v4_unweighted_rms_norm is None and ops.hc_pre is None:
            return False
        self.fused_mix, self.fused_merge, self.fused_norm = ops.hc_mix, ops.hc_merge, ops.v4_unweighted_rms_norm
        self.fused_pre = ops.hc_pre
        return True


def hc_mix_reference(
    mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor, iters: int, eps: float
):
    """The mHC weights from the mixing projection ``mixed`` [T, (2 + hc) * hc] (float32):
    ``pre`` (sigmoid), ``post`` (2 * sigmoid), ``comb`` (softmax rows, then ``iters`` Sinkhorn
    column / row normalisations), and the streams [T, hc, D] collapsed by ``pre``. Returns
    (post [T, hc], comb [T, hc, hc], collapsed [T, D] in the streams' dtype). About 4 torch
    kernels per Sinkhorn iteration (V4: 20): what ``FusedOps.hc_mix`` does in one launch."""
    hc = streams.shape[1]
    pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.unbind(0)
    comb_w = comb_w.view(-1, hc, hc)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w * comb_s + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand a block's output into the streams and add the comb-mixed residual streams."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the streams (``model.hc_head``)."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(cfg.hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hc, D] -> [T, D]
        flat = unweighted_rms_norm(x.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


class GroupedLinear(nn.Linear):
    """Block-diagonal projection: group g of the input maps through its own rows of ``weight``."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, G, in] -> [T, G, out/G]
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        y = torch.bmm(x.transpose(0, 1), w).transpose(0, 1)
        return y


class ClampedMLP(nn.Module):
    """Shared expert: SwiGLU with gate clamped above and up clamped both sides at ``limit``."""

    def __init__(self, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_up_proj = FusedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


def moe_spec(cfg: V4Config, index: int) -> MoESpec:
    hashed = cfg.mlp_kinds[index] == "hash_moe"
    return MoESpec(
        layer_index=index,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        scoring="hash" if hashed else cfg.scoring,
        hash_scoring=cfg.scoring,
        normalize_topk=True,  # V4 always renormalises the chosen weights
        routed_scaling=cfg.routed_scaling,
        num_shared_experts=1,
        swiglu_limit=cfg.swiglu_limit,
    )


class V4Router(nn.Module):
    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if hashed:
            # int32 as shipped: int64 doubled a 129K-token table (6 MiB a hash layer in V4-mini)
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.top_k, dtype=torch.int32))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))


class V4Experts(nn.Module):
    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        E, I, D = spec.num_experts, spec.intermediate_size, spec.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))


class V4MoE(SharedExpertFold, nn.Module):
    """Routed experts through the MoE hook (learned sqrtsoftplus or hash routing) + shared expert."""

    def __init__(self, cfg: V4Config, spec: MoESpec, dispatcher: MoEDispatcher) -> None:
        super().__init__()
        self.spec, self.dispatcher = spec, dispatcher
        self.hashed = spec.scoring == "hash"
        self.gate = V4Router(cfg, self.hashed)
        self.experts = V4Experts(spec)
        self.shared_experts = ClampedMLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
        self.expert_load = None  # ModelContext.expert_load, set by the model once built

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:  # [T, D]
        logits = F.linear(x, self.gate.weight)  # model dtype, as the reference
        if self.hashed:
            ids, weights = self.dispatcher.select_experts(
                self.spec, logits, None, token_ids=input_ids, hash_table=self.gate.tid2eid
            )
        else:
            ids, weights = self.dispatcher.select_experts(self.spec, logits, self.gate.e_score_correction_bias)
        if self.expert_load is not None:
            self.expert_load.record(self.spec.layer_index, ids)
        experts = ExpertWeights(
            gate_up=self.experts.gate_up_proj, down=self.experts.down_proj,  # MXFP4 kept packed (models.mxfp4)
            gate_up_scale=getattr(self.experts, "gate_up_scale", None),  # adds its scales
            down_scale=getattr(self.experts, "down_scale", None),
        )  # fmt: skip
        # optional: the shared expert in the routed experts' launches (clamped by spec.swiglu_limit
        # as they are: ClampedMLP's rule)
        out = self.forward_folded(x, ids, weights, experts)
        if out is not None:
            return out
        routed = self.dispatcher.forward(self.spec, x, ids, weights, experts)
        return routed + self.shared_experts(x)
