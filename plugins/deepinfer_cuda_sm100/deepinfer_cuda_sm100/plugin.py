"""The hooks of the ``cuda_sm100`` plugin (entry point group ``deepinfer``).

Kernel hooks answer only for CUDA platforms. With Triton importable they return the Triton
backends; without it, attention falls back to the portable torch path and MoE to the builtin.
Nothing here imports Triton or touches the GPU at import time.
"""

from __future__ import annotations

from deepinfer_core.attention import AttentionLayerSpec
from deepinfer_core.attention.v4_ref import SUPPORTED_V4
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.moe import MoESpec, ParallelConfig
from deepinfer_core.platform import Platform, PlatformRequest, ProbeResult

from .attention import (
    PORTABLE_KINDS,
    TRITON_KINDS,
    PortableCudaAttention,
    PortableCudaV4Attention,
    TritonAttention,
    TritonV4Attention,
    triton_available,
)
from .moe import SCORINGS, TritonMoEDispatcher
from .platform import CudaSM100Platform

DEEPINFER_CONTRACT = 2  # the deepinfer contract version this plugin is built for


@hookimpl
def deepinfer_probe() -> ProbeResult:
    return CudaSM100Platform().probe()


@hookimpl
def deepinfer_platform(request: PlatformRequest) -> Platform | None:
    if request.device_type in ("auto", "cuda"):
        return CudaSM100Platform(request.index)
    return None


@hookimpl
def deepinfer_attention_backend(layer: AttentionLayerSpec, platform: Platform):
    if platform.device_type != "cuda":
        return None
    if layer.state_kv:  # DeepSeek-V4 layouts
        if layer.kind not in SUPPORTED_V4:
            return None
        return TritonV4Attention() if triton_available() else PortableCudaV4Attention()
    if layer.kind in TRITON_KINDS and triton_available():
        return TritonAttention()
    if layer.kind in PORTABLE_KINDS:
        return PortableCudaAttention()
    return None


@hookimpl
def deepinfer_moe_dispatcher(moe: MoESpec, platform: Platform, parallel: ParallelConfig):
    if platform.device_type != "cuda" or moe.scoring not in SCORINGS or parallel.ep_size != 1 or not triton_available():
        return None
    return TritonMoEDispatcher()


@hookimpl
def deepinfer_decode_graphs(platform: Platform):
    if platform.device_type != "cuda":
        return None
    from .graphs import CudaDecodeGraphs

    return CudaDecodeGraphs


@hookimpl
def deepinfer_batch_invariant_ops(platform: Platform):
    if platform.device_type != "cuda" or not triton_available():
        return None
    from .kernels.invariant import BatchInvariantOps

    return BatchInvariantOps


@hookimpl
def deepinfer_fused_ops(platform: Platform):
    if platform.device_type != "cuda" or not triton_available():
        return None
    from dataclasses import replace
    from functools import partial

    from .kernels.bf16_gemv import dense_linear, head_linear
    from .kernels.fp8_gemm import SplitCounters, fp8_linear, fp8_supported
    from .kernels.fused_elementwise import FUSED_OPS
    from .kernels.fused_moe import mxfp4_moe
    from .kernels.hyper_connection import hc_merge, hc_mix, hc_pre
    from .kernels.logits import lm_logits
    from .kernels.v4_elementwise import v4_rms_norm, v4_rope, v4_unweighted_rms_norm

    ops = replace(
        FUSED_OPS,
        hc_mix=hc_mix,
        hc_merge=hc_merge,
        hc_pre=hc_pre,  # decode batches: the input norm and the mixing projection inside hc_mix's launch pair
        logits=lm_logits,
        v4_rms_norm=v4_rms_norm,
        v4_rope=v4_rope,
        v4_unweighted_rms_norm=v4_unweighted_rms_norm,  # logits: float32 from the 16-bit head
        dense_linear=partial(dense_linear, counters=SplitCounters()),
        head_linear=head_linear,  # 1-2 row GEMVs
        mxfp4_moe=mxfp4_moe,  # plain Triton (SM90 too): the engine keeps DeepSeek-V4's MXFP4 experts packed
    )
    # FP8 weights (kept FP8 by the loader when this is offered) where the chip converts e4m3;
    # decode GEMMs split along K sum their splits in-kernel (counters owned by this engine's ops)
    return replace(ops, fp8_linear=partial(fp8_linear, counters=SplitCounters())) if fp8_supported(platform) else ops
