"""Fused elementwise kernels a platform plugin may provide (hook ``deepinfer_fused_ops``).

Why: in a decode step every RMSNorm is ~8 small torch kernels (upcast, square, mean, add,
rsqrt, multiply, downcast, scale) and every SwiGLU two more; on a GPU each costs a launch and a
round trip through memory, a large share of a small step (benchmarks/README.md). A plugin
replaces them with one kernel each (and MLA's rotary + query/key concatenation, ~22 kernels a
layer, with two). The references below define what a kernel must compute;
plugin tests compare their kernels with them.

The engine installs the ops on the model's modules once, after loading (:func:`install`);
``LLM(fused_ops=False)`` keeps the model's own torch ops (the reference path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "FusedOps",
    "add_rms_norm_reference",
    "logits_reference",
    "norm_rope_cat_reference",
    "rms_norm_reference",
    "rope_cat_reference",
    "rotary_reference",
    "silu_and_mul_reference",
]


@dataclass(frozen=True)
class FusedOps:
    """Each field is a kernel, or None where the plugin has none (the torch ops run)."""

    # (x [..., D], weight [D], eps) -> like rms_norm_reference: x's shape, dtype of weight * x
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    # (x [..., 2 I]) -> [..., I]: silu(first half) * second half, x's dtype
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    # (latent [T, H, C], pe [T, H, r], positions [T], cos [P, r], sin [P, r], interleaved)
    # -> [T, H, C + r]: like rope_cat_reference (MLA's query / key assembly)
    rope_cat: (
        Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor] | None
    ) = None
    # (latent [T, C], weight [C] latent's dtype, eps, pe [T, 1, r], positions [T], cos, sin,
    # interleaved) -> [T, 1, C + r]: like norm_rope_cat_reference (MLA's key: kv_a's RMSNorm
    # inside the key's rope_cat, one launch a layer less); used only where rms_norm and rope_cat are
    # fused too (fused_ops.install)
    norm_rope_cat: Callable[..., torch.Tensor] | None = None
    # (x [..., K], weight float8_e4m3fn [N, K], scale_inv float32 [ceil(N/128), ceil(K/128)])
    # -> [..., N] in x's dtype: x @ (weight * tile scales)^T (models.fp8.Fp8Linear). Offering it
    # also makes the engine keep FP8 block checkpoints FP8 (engine.loading.keep_fp8).
    fp8_linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (hidden [T, D], experts ExpertWeights holding MXFP4 (uint8 packed e2m1 + uint8 UE8M0 per 32,
    # moe.ExpertWeights), topk_ids [T, k], topk_weights [T, k] float32, swiglu_limit or None)
    # -> [T, D] in hidden's dtype: like moe.torch_ref's forward on experts.dequantized(hidden.dtype).
    # Offering it makes the engine keep DeepSeek-V4's MXFP4 routed experts packed
    # (engine.loading.keep_mxfp4, models.mxfp4); the MoE dispatcher runs them (a dispatcher that
    # does not know the format widens them per call through ExpertWeights.dequantized).
    mxfp4_moe: Callable[..., torch.Tensor] | None = None
    # (x [..., D], residual [..., D], weight [D], eps) -> (normed, residual + x): like
    # add_rms_norm_reference, the decoder's residual add fused with the norm that follows it
    add_rms_norm: (
        Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]] | None
    ) = None
    # (x [T, H, d], cos [T, 1, d], sin [T, 1, d], both x's dtype) -> [T, H, d]: like
    # rotary_reference (models.layers.RotaryAt: Llama's q and k rotated together)
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (mixed [T, (2 + hc) * hc] float32, base [(2 + hc) * hc], scale [3], streams [T, hc, D], iters, eps)
    # -> (post [T, hc], comb [T, hc, hc], collapsed [T, D]): like
    # models.deepseek_v4_layers.hc_mix_reference (DeepSeek-V4's hyper-connection weights, Sinkhorn included)
    hc_mix: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # (streams [T, hc, D], fn [(2 + hc) * hc, hc * D] float32, base, scale, iters, eps, norm_eps)
    # -> hc_mix's triple, or None to decline (the torch ops and hc_mix run): like
    # models.deepseek_v4_layers.HyperConnection.forward whole (the input norm, the mixing
    # projection, hc_mix_reference); a platform's decode path in fewer launches
    hc_pre: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] | None = None
    # (streams [T, hc, D], out [T, D], post [T, hc] float32, comb [T, hc, hc] float32) -> [T, hc, D]:
    # like models.deepseek_v4_layers.hc_merge (a V4 block's output expanded into the mixed streams)
    hc_merge: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (hidden [N, D] 16-bit, weight [V, D] same dtype) -> [N, V] float32: like logits_reference,
    # the LM head's product kept in float32 (not rounded to hidden's dtype before the sampler)
    logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (x [..., D], weight [D] float32, eps) -> x's shape and dtype: like
    # models.deepseek_v4_layers.V4RMSNorm (the weight applied in float32 before the one rounding)
    v4_rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    # (x [T, H, D] or [T, D], cos [T, r/2], sin [T, r/2] in x's dtype) -> x's shape: like
    # models.deepseek_v4_layers.V4Rope.apply (DeepSeek-V4 attention's query / key / output rope)
    v4_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (x [..., D], eps) -> x's shape and dtype: like models.deepseek_v4_layers.unweighted_rms_norm
    # (the rsqrt rounded to x's dtype before the product; V4's query norm and the hyper-connections' input norm)
    v4_unweighted_rms_norm: Callable[[torch.Tensor, float], torch.Tensor] | None = None
    # (x [..., K], weight [N, K] x's dtype, norm=None) -> [..., N]: F.linear(x, weight), bias-free,
    # of rms_norm(x, g, eps) when norm=(g, eps) is given (MLA's q_a norm before q_b); a decode GEMV
    # for a few 16-bit rows where torch's GEMM reads weights slowly (the kernel hands any other
    # case, float32 included, to the norm and F.linear itself). Installed on MLAAttention's and
    # GatedMLP's plain linears; offering it also has install() store MLA's q_a and kv_a weights as
    # one [N_q + N_kv, K] tensor (MLAAttention.qkv_a_weight, the parameters views of it): one launch.
    dense_linear: Callable[..., torch.Tensor] | None = None
    # (x [T, H, K], weight [H, N, K], any strides) -> [T, H, N]: einsum("thk,hnk->thn") (MLA's
    # absorbed W_UK / W_UV products on views of kv_b_proj), the kernel falling back itself
    head_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, round to x's dtype, then scale by the weight (Llama's order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` (rounded to their dtype, as torch adds), then
    ``(rms_norm_reference(h), h)``."""
    h = residual + x
    return rms_norm_reference(h, weight, eps), h


def logits_reference(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head in float32 from 16-bit operands. Why: rounding logits to bfloat16 (8
    mantissa bits: steps of 0.125 at magnitudes 16-32) turns near-ties of the float32 model into
    coin flips for greedy decoding; a GEMM accumulates in float32 anyway, so keeping its output
    costs 4 instead of 2 bytes per logit and no extra pass."""
    return F.linear(hidden.float(), weight.float())


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary at fixed positions, each product and the sum rounded to x's dtype."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cat_reference(
    latent: torch.Tensor,
    pe: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """``cat([latent, rotary(pe)])`` as DeepSeek's MLA builds queries and keys: the rope channels
    de-interleaved (evens, then odds) when ``interleaved``, rotated in the rotate-half layout with
    the cos/sin rows of ``positions`` (cast to pe's dtype), each product rounded to that dtype."""
    if interleaved:
        pe = torch.cat([pe[..., 0::2], pe[..., 1::2]], dim=-1)
    c = cos[positions][:, None, :].to(pe.dtype)
    s = sin[positions][:, None, :].to(pe.dtype)
    half = pe.shape[-1] // 2
    rotated = torch.cat([-pe[..., half:], pe[..., :half]], dim=-1)
    return torch.cat([latent, pe * c + rotated * s], dim=-1)


def norm_rope_cat_reference(
    latent: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pe: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """MLA's cache entry: ``rope_cat_reference(rms_norm_reference(latent)[:, None], pe, ...)``."""
    return rope_cat_reference(rms_norm_reference(latent, weight, eps)[:, None, :], pe, positions, cos, sin, interleaved)


def install(model: torch.nn.Module, ops: FusedOps | None) -> int:
    """Offer ``ops`` to every module of ``model``; returns how many modules now use a fused kernel.

    Each module that can run one takes what it uses itself: ``use_fused_ops(ops) -> bool`` (RMSNorm,
    gated MLP, rotary, MLA, FP8 linear, DeepSeek-V4's norms, hyper-connections and attention), so
    this contract knows no model class; a model's LM head takes ``ops.logits`` through its
    ``logits_kernel`` attribute."""
    if ops is None:
        return 0
    n = 0
    for module in model.modules():
        use = getattr(module, "use_fused_ops", None)
        if use is not None and use(ops):
            n += 1
        elif ops.logits is not None and "logits_kernel" in type(module).__dict__:  # a model's LM head
            module.logits_kernel = ops.logits
            n += 1
    return n
