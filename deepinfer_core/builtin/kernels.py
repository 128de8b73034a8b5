"""Builtin pure-torch attention and MoE: the reference every plugin is tested against."""

from __future__ import annotations

from ..attention import AttentionLayerSpec
from ..attention.torch_ref import SUPPORTED, TorchAttentionBackend
from ..attention.v4_ref import SUPPORTED_V4, TorchV4AttentionBackend
from ..hookspecs import hookimpl
from ..moe import MoESpec
from ..moe.ep import ExpertParallelDispatcher
from ..moe.torch_ref import TorchMoEDispatcher


@hookimpl(trylast=True)
def deepinfer_attention_backend(layer: AttentionLayerSpec, platform):
    if layer.state_kv:
        return TorchV4AttentionBackend() if layer.kind in SUPPORTED_V4 else None
    if layer.kind in SUPPORTED:
        return TorchAttentionBackend()
    return None


@hookimpl(trylast=True)
def deepinfer_moe_dispatcher(moe: MoESpec, platform, parallel):
    if moe.scoring not in ("softmax", "sigmoid", "sqrtsoftplus", "hash"):
        return None
    return TorchMoEDispatcher() if parallel.ep_size == 1 else ExpertParallelDispatcher(moe, parallel)
