"""The LM head with float32 logits from 16-bit weights (``FusedOps.logits``).

Why: a bf16 head rounds every logit to 8 mantissa bits (steps of 0.125 between 16 and 32), so
wherever the float32 model's top two logits are closer than that, greedy decoding in bf16
picks by rounding. cuBLAS accumulates a bf16 GEMM in float32 anyway: asking it for float32
output (``torch.mm(..., out_dtype=torch.float32)``) keeps those bits for the price of writing
4 instead of 2 bytes per logit, and drops the separate cast kernel the engine ran after the head.
Inside a batch-invariant forward the fixed-order matmul writes float32 instead, so a row's
logits still do not depend on its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .invariant import INVARIANT, bmm


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden [..., D] @ weight [V, D]^T`` -> ``[..., V]`` float32, accumulated in float32
    and rounded only to float32 (deepinfer_core.fused_ops.logits_reference)."""
    x = hidden.reshape(-1, hidden.shape[-1])
    if hidden.is_cuda and INVARIANT.get():
        out = bmm(x[None], weight.t()[None], out_dtype=torch.float32)[0]
    elif hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype:
        out = torch.mm(x, weight.t(), out_dtype=torch.float32)
    else:  # elsewhere (CPU tests, other dtypes): the reference's float32 product
        out = F.linear(x.float(), weight.float())
    return out.view(*hidden.shape[:-1], weight.shape[0])
