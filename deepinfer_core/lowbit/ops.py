"""Tensor-level entry point to the native kernel: ``x @ W^T`` with W packed.

Activations stay float32 (see kernels.c for why they are not rounded to int8).
"""
from __future__ import annotations

import torch

from .formats import QuantWeight
from .native import load


def matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:  # [M, K] x [N, K]^T -> [M, N] float32
    kernels = load()
    if kernels.lib is None:
        raise RuntimeError(f"low-bit kernels unavailable: {kernels.reason}")
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    M, K = x.shape
    if w.shape[1] != K:
        raise ValueError(f"weight has K={w.shape[1]}, activations K={K}")
    N = w.qs.shape[0]
    y = torch.empty(M, N)
    m_ptr = w.m.data_ptr() if w.m is not None else None
    kernels.lib.gemm_f32_act(x.data_ptr(), M, K, 4 if w.kind == "q4" else 8, w.qs.data_ptr(), w.d.data_ptr(), m_ptr,
                             N, y.data_ptr(), torch.get_num_threads())
    return y
