"""Attention on CUDA. For now the portable path only: the core's torch reference backend run on
the GPU. Triton/CUDA kernels for SM100 will replace it kind by kind, behind the same class
interface and the same conformance suite."""
from __future__ import annotations

from deepinfer_core.attention import AttentionKind
from deepinfer_core.attention.torch_ref import SUPPORTED, TorchAttentionBackend

PORTABLE_KINDS: frozenset[AttentionKind] = frozenset(SUPPORTED)


class PortableCudaAttention(TorchAttentionBackend):
    """The torch reference attention (paged cache, SDPA) on a CUDA device; correct, not fast."""

    name = "cuda-sm100-portable"
