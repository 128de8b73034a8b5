"""MoE on CUDA: the reference router (a handful of row-wise torch ops, no host sync) and the
fused Triton expert computation of :mod:`deepinfer_cuda_sm100.kernels.fused_moe`."""

from __future__ import annotations

from dataclasses import replace

import torch

from deepinfer_core.moe import ExpertWeights, MoESpec
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus", "hash")


class TritonMoEDispatcher(TorchMoEDispatcher):
    """Routing as the reference (so the same experts are chosen); experts through two grouped
    GEMMs over expert-sorted rows with SiLU-and-mul and the routing weights fused in."""

    name = "cuda-sm100-triton-moe"

    def select_experts(self, spec: MoESpec, router_logits, correction_bias=None, **kwargs):
        """The reference routing. Inside a batch-invariant forward, each token's choices are put
        in expert order before the weights are normalised: ``topk(sorted=False)`` returns them in
        an order that depends on the batch's shape, and the normalising sum (and the final sum
        over a token's k rows) would otherwise round differently alone and in a batch."""
        from .kernels.invariant import INVARIANT
        from .kernels.routing import fused_routing_supported, route

        if not INVARIANT.get():
            if fused_routing_supported(spec, correction_bias) and router_logits.dim() == 2:
                return route(spec, router_logits, correction_bias)  # one launch instead of ~15
            return super().select_experts(spec, router_logits, correction_bias, **kwargs)
        raw = replace(spec, normalize_topk=False, routed_scaling=1.0)
        ids, weights = super().select_experts(raw, router_logits, correction_bias, **kwargs)
        ids, order = ids.sort(dim=-1)
        weights = weights.gather(1, order)
        if spec.normalize_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * spec.routed_scaling

    def router_logits(self, hidden, weight):
        """A few 16-bit decode rows in one launch (kernels/router.py: the cast folded into the
        float32 GEMV); float32 rows, larger batches and batch-invariant forwards keep torch's."""
        from .kernels.invariant import INVARIANT
        from .kernels.router import router_logits

        if hidden.dtype == torch.float32 or INVARIANT.get() or hidden.dim() != 2:
            return super().router_logits(hidden, weight)
        return router_logits(hidden, weight)

    def forward(self, spec: MoESpec, hidden, topk_ids, topk_weights, experts: ExpertWeights):
        from .kernels.fused_moe import MoEConfig, fused_moe
        from .kernels.invariant import INVARIANT

        if experts.gate_up.stride(-1) != 1 or experts.down.stride(-1) != 1:
            raise ValueError("TritonMoEDispatcher: expert weights need a contiguous last dimension")
        config = MoEConfig(16, 64, 64, 4, 3) if INVARIANT.get() else None  # one tiling for every batch
        out, counts = fused_moe(
            hidden, experts.gate_up, experts.down, topk_ids, topk_weights, spec.swiglu_limit, config,
            gate_up_scale=experts.gate_up_scale, down_scale=experts.down_scale,
        )  # fmt: skip
        if not (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):  # graph replays are not counted
            self._load = counts if self._load is None else self._load + counts
        return out

    def forward_with_shared(
        self, spec: MoESpec, hidden, topk_ids, topk_weights, experts: ExpertWeights, shared: ExpertWeights
    ):
        """Routed experts plus the shared expert, its output summed in float32 with the routed
        rows and rounded once (the separate path rounds the routed sum and the shared output,
        then adds). A few 16-bit decode rows: the shared expert is each token's last row of the
        same two GEMV launches (an FP8 shared expert beside MXFP4 routed ones too, DeepSeek-V4's
        release), clamped by ``spec.swiglu_limit`` as the routed rows are (the caller's shared
        expert must compute so: V4's does). Larger 16-bit batches (:meth:`_grouped_with_shared`):
        the shared MLP on cuBLAS, added inside the routed rows' sum (prefill: one read-add-write
        pass over the hidden state a layer fewer), without a SwiGLU clamp. None where neither
        applies (batch-invariant forwards, float32, other shapes): the caller then runs the
        shared expert itself."""
        from .kernels.fused_moe import _counts, _sum_rows, _use_gemv
        from .kernels.invariant import INVARIANT
        from .kernels.moe_gemv import moe_gemv, shared_fits

        T, k = topk_ids.shape
        gs, ds = experts.gate_up_scale, experts.down_scale
        if INVARIANT.get() or (gs is None) != (ds is None) or hidden.dim() != 2:
            return None
        if not _use_gemv(False, T * (k + 1), hidden, experts.gate_up):
            return self._grouped_with_shared(spec, hidden, topk_ids, topk_weights, experts, shared)
        if not shared_fits(shared, experts.gate_up, experts.down, gs, ds):
            return None
        if experts.gate_up.stride(-1) != 1 or experts.down.stride(-1) != 1:
            return None
        rows = moe_gemv(
            hidden.contiguous(), experts.gate_up, experts.down, topk_ids, topk_weights, spec.swiglu_limit, gs, ds,
            shared=shared,
        )  # fmt: skip
        counts = _counts(topk_ids, experts.gate_up.shape[0])
        if counts is not None:  # graph replays are not counted
            self._load = counts if self._load is None else self._load + counts
        return _sum_rows(rows, hidden, k + 1)

    def _grouped_with_shared(
        self, spec: MoESpec, hidden, topk_ids, topk_weights, experts: ExpertWeights, shared: ExpertWeights
    ):
        """The grouped-GEMM forward with the shared expert's output as one more addend of each
        token's fixed-order sum; 16-bit activations with 16-bit routed and shared weights of
        their dtype only (FP8 shared experts keep the caller's path)."""
        from .kernels.fused_elementwise import silu_and_mul
        from .kernels.fused_moe import fused_moe

        dtype = hidden.dtype
        if (
            spec.swiglu_limit is not None  # the shared MLP below has no clamp
            or dtype not in (torch.bfloat16, torch.float16)
            or experts.gate_up_scale is not None
            or experts.gate_up.dtype != dtype
        ):
            return None
        if (
            shared is None
            or shared.gate_up_scale is not None
            or shared.down_scale is not None
            or shared.gate_up.shape[0] != 1
        ):
            return None
        w1, w2 = shared.gate_up[0], shared.down[0]  # [2I_s, D], [D, I_s]
        D = hidden.shape[1]
        if (
            w1.dtype != dtype
            or w2.dtype != dtype
            or w1.shape[1] != D
            or w2.shape[0] != D
            or w1.shape[0] != 2 * w2.shape[1]
        ):
            return None
        if experts.gate_up.stride(-1) != 1 or experts.down.stride(-1) != 1:
            return None
        extra = torch.nn.functional.linear(silu_and_mul(torch.nn.functional.linear(hidden, w1)), w2)
        out, counts = fused_moe(hidden, experts.gate_up, experts.down, topk_ids, topk_weights, None, None, addend=extra)
        if counts is not None and not (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._load = counts if self._load is None else self._load + counts
        return out

    def expert_load(self) -> torch.Tensor | None:
        return super().expert_load()
