"""Builtin pure-torch attention and MoE: the reference every plugin is tested against."""
from __future__ import annotations

from ..attention import AttentionLayerSpec
from ..attention.torch_ref import SUPPORTED, TorchAttentionBackend
from ..hookspecs import hookimpl
from ..moe import MoESpec
from ..moe.torch_ref import TorchMoEDispatcher


@hookimpl(trylast=True)
def deepinfer_attention_backend(layer: AttentionLayerSpec, platform):
    if layer.kind in SUPPORTED:
        return TorchAttentionBackend()
    return None


@hookimpl(trylast=True)
def deepinfer_moe_dispatcher(moe: MoESpec, platform, parallel):
    if moe.scoring in ("softmax", "sigmoid", "sqrtsoftplus") and parallel.ep_size == 1:
        return TorchMoEDispatcher()
    return None
