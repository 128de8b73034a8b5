"""Tensor-level entry points to the native kernels: quantize activations, multiply.

Activations are quantized per row and per 32-block (a scale for every 32 values of every token,
finer than a per-token scale), so one outlier channel only coarsens its own block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import QK, QuantWeight
from .native import load


@dataclass(frozen=True)
class QuantActivations:
    qx: torch.Tensor  # [M, K] int8
    dx: torch.Tensor  # [M, K/32] float32 scale
    sx: torch.Tensor  # [M, K/32] float32 sum of the block's float values (for q4's offsets)


def _lib():
    kernels = load()
    if kernels.lib is None:
        raise RuntimeError(f"low-bit kernels unavailable: {kernels.reason}")
    return kernels.lib


def quantize_activations(x: torch.Tensor) -> QuantActivations:  # x [M, K] float32
    lib = _lib()
    x = x.float().contiguous()
    M, K = x.shape
    if K % QK:
        raise ValueError(f"activation width {K} is not a multiple of {QK}")
    qx = torch.empty(M, K, dtype=torch.int8)
    dx = torch.empty(M, K // QK)
    sx = torch.empty(M, K // QK)
    lib.quantize_rows(x.data_ptr(), M, K, qx.data_ptr(), dx.data_ptr(), sx.data_ptr(), torch.get_num_threads())
    return QuantActivations(qx, dx, sx)


def matmul(a: QuantActivations, w: QuantWeight) -> torch.Tensor:  # [M, K] x [N, K]^T -> [M, N] float32
    lib = _lib()
    M, K = a.qx.shape
    N = w.qs.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"weight has K={w.shape[1]}, activations K={K}")
    y = torch.empty(M, N)
    threads = torch.get_num_threads()
    if w.kind == "q4":
        lib.gemm_q4(a.qx.data_ptr(), a.dx.data_ptr(), a.sx.data_ptr(), M, K,
                    w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), N, y.data_ptr(), threads)
    else:
        lib.gemm_q8(a.qx.data_ptr(), a.dx.data_ptr(), M, K, w.qs.data_ptr(), w.d.data_ptr(), N, y.data_ptr(), threads)
    return y
