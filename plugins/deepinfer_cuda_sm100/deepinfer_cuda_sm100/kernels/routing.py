"""Learned MoE routing in one Triton program per token: scores (sigmoid, softmax or V4's
sqrt-softplus), the selection bias, DeepSeek's group limit (a group scores the sum of its two best experts with a
bias, else its best), top-k, weights gathered from the unbiased scores, normalised and scaled.

Why: the reference routing is ~15 small torch launches per MoE layer (sigmoid, add, views, three
top-k's, scatter, masked fill, gather, sum, divide, scale); in a one-request decode step those
launches, not arithmetic, are the cost. The experts chosen are the reference's (the same
scores and masks; ties go to the lower expert index); ids come best first and the weights are
the same numbers up to the order of the normalising sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import gdc_enter, launch_kw


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    w_ptr,
    E,
    stride_l,
    scaling,
    E_P: tl.constexpr,
    G: tl.constexpr,
    TOPK_G: tl.constexpr,
    K: tl.constexpr,
    K_P: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SQRTSOFTPLUS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    gdc_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P)
    ok = e < E
    logit = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf"))
    if SOFTMAX:
        p = tl.exp(logit - tl.max(logit, axis=0))
        scores = p / tl.sum(p, axis=0)
    elif SQRTSOFTPLUS:  # DeepSeek-V4: sqrt(softplus(x)), softplus as torch's (x itself above 20)
        y = tl.exp(tl.minimum(logit, 20.0))
        u = 1.0 + y
        log1p = tl.where(
            u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0))
        )  # log1p(y) to float32 accuracy
        scores = tl.sqrt(tl.where(logit > 20.0, logit, log1p))
    else:
        scores = 1.0 / (1.0 + tl.exp(-logit))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=ok, other=0.0)
    choice = tl.where(ok, choice, float("-inf"))
    if G > 1:  # keep the TOPK_G best groups (E_P == E, a multiple of G)
        grouped = tl.reshape(choice, (G, E_P // G))
        best = tl.max(grouped, axis=1)
        if HAS_BIAS:  # DeepSeek-V3: a group's score is its two best experts' sum
            col = tl.arange(0, E_P // G)
            first = tl.argmax(grouped, axis=1)
            best = best + tl.max(tl.where(col[None, :] == first[:, None], float("-inf"), grouped), axis=1)
        g = tl.arange(0, G)
        keep = g < 0
        for _ in tl.static_range(TOPK_G):
            pick = tl.argmax(tl.where(keep, float("-inf"), best), axis=0)
            keep = keep | (g == pick)
        choice = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (E_P,))
    slots = tl.arange(0, K_P)
    ids = tl.zeros([K_P], tl.int32)
    weights = tl.zeros([K_P], tl.float32)
    for j in tl.static_range(K):
        pick = tl.argmax(choice, axis=0)
        ids = tl.where(slots == j, pick, ids)
        weights = tl.where(slots == j, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), weights)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(ids_ptr + t * K + slots, ids.to(tl.int64), mask=slots < K)
    tl.store(w_ptr + t * K + slots, weights * scaling, mask=slots < K)


def fused_routing_supported(spec, correction_bias) -> bool:
    """Learned sigmoid / softmax / sqrtsoftplus routing with at most one bias; groups need a
    power-of-two E."""
    E, G = spec.num_experts, spec.num_groups
    if spec.scoring not in ("sigmoid", "softmax", "sqrtsoftplus") or spec.top_k > E or E > 1024:
        return False
    return G <= 1 or (E >= 16 and E & (E - 1) == 0 and (G & (G - 1)) == 0 and G <= E)


def route(spec, router_logits: torch.Tensor, correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids [T, k] int64, topk_weights [T, k] float32)`` as the reference routing."""
    logits = router_logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    T, E = logits.shape
    k = spec.top_k
    ids = torch.empty(T, k, dtype=torch.long, device=logits.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        bias = correction_bias.float().contiguous() if correction_bias is not None else logits
        groups = spec.num_groups if spec.num_groups > 1 else 1
        _route_kernel[(T,)](
            logits, bias, ids, weights, E, logits.stride(0), float(spec.routed_scaling),
            E_P=max(16, triton.next_power_of_2(E)), G=groups, TOPK_G=spec.topk_groups if groups > 1 else 1,
            K=k, K_P=max(2, triton.next_power_of_2(k)),
            SOFTMAX=spec.scoring == "softmax", HAS_BIAS=correction_bias is not None,
            NORMALIZE=bool(spec.normalize_topk), SQRTSOFTPLUS=spec.scoring == "sqrtsoftplus",
            **launch_kw(logits), num_warps=1 if E <= 256 else 4,
        )  # fmt: skip
    return ids, weights
