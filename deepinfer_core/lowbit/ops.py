"""Tensor-level entry point to the native kernels: ``x @ W^T`` with W packed.

Two kernels (kernels.c says how each works): the exact one keeps activations float32; the
integer one rounds them to 16 bits per 32-block and uses integer dot products, 2-3x faster for
one token and slower than the exact panel kernel from about 4-8 tokens on. :func:`int_rows`
says up to how many rows a call takes the integer kernel; ``DEEPINFER_LOWBIT_EXACT=1`` (or
``DEEPINFER_LOWBIT_INT_ROWS=0``) keeps every call on the exact kernel.
"""
from __future__ import annotations

import os

import torch

from .formats import QuantWeight
from .native import load

DEFAULT_INT_ROWS = 4  # where the integer kernel stops winning on the 2-vCPU Zen 3 (benchmarks/README.md)


def int_rows(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> int:
    """Calls with at most this many rows take the integer kernel (0: none). Read when a model is
    built, not per call."""
    if environ.get("DEEPINFER_LOWBIT_EXACT", "0") not in ("", "0"):
        return 0
    raw = environ.get("DEEPINFER_LOWBIT_INT_ROWS", "")
    if raw == "":
        return DEFAULT_INT_ROWS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"DEEPINFER_LOWBIT_INT_ROWS={raw!r}: expected a whole number >= 0 (rows up to which activations are rounded to int16)")
    return value


def matmul(x: torch.Tensor, w: QuantWeight, max_int_rows: int = 0) -> torch.Tensor:  # [M, K] x [N, K]^T -> [M, N] float32
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
    kernel = kernels.lib.gemm_i16_act if M <= max_int_rows else kernels.lib.gemm_f32_act
    kernel(x.data_ptr(), M, K, 4 if w.kind == "q4" else 8, w.qs.data_ptr(), w.d.data_ptr(), m_ptr, N, y.data_ptr(), torch.get_num_threads())
    return y
