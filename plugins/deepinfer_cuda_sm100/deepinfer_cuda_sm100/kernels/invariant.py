"""Batch-invariant matmuls and row means for ``batch_invariant=True`` engines.

cuBLAS picks a different kernel (tile shape, split-K) for a different number of rows, and
torch's reductions split a row across blocks when there are few rows, so a request's numbers
change with the rest of its batch. Here every output element is one program's fixed-order loop
over K (one tile configuration for every M, no split-K), and every row mean is one program's
fixed-order loop over the row: a row's result depends on that row alone.

:class:`BatchInvariantOps` is a ``TorchDispatchMode`` that routes ``aten.mm``, ``aten.addmm``,
``aten.bmm`` and last-dimension ``aten.mean`` / ``aten.sum`` (e.g. the sum of a token's top-k
routing weights) to these kernels (everything else passes through)
and tells the fused MoE to keep one tile configuration.
"""

from __future__ import annotations

import contextvars

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from .paged_attention import interpreting

# Read by the MoE dispatcher: inside a batch-invariant forward, one fixed tile configuration.
INVARIANT = contextvars.ContextVar("deepinfer_cuda_sm100_batch_invariant", default=False)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])
def _bmm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    s_ab,
    s_am,
    s_ak,
    s_bb,
    s_bk,
    s_bn,
    s_cb,
    s_cm,
    s_cn,
    s_xb,
    s_xm,
    s_xn,
    alpha,
    beta,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + batch * s_ab + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak,
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + batch * s_bb + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn,
            mask=(rk[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        x = tl.load(
            bias_ptr + batch * s_xb + rm[:, None].to(tl.int64) * s_xm + rn[None, :] * s_xn, mask=mask, other=0.0
        )
        acc = beta * x.to(tl.float32) + alpha * acc
    tl.store(
        c_ptr + batch * s_cb + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _row_reduce_kernel(x_ptr, out_ptr, D, s_x, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * s_x + d, mask=d < D, other=0.0).to(tl.float32)
    total = tl.sum(acc, 0)
    if MEAN:
        total = total / D
    tl.store(out_ptr + row, total.to(out_ptr.dtype.element_ty))


def bmm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    beta: float = 1.0,
    alpha: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``beta * bias + alpha * (a @ b)`` for ``a [B, M, K]``, ``b [B, K, N]`` (any strides), in
    ``out_dtype`` (default a's: the float32 accumulator rounded once at the store)."""
    B, M, K = a.shape
    N = b.shape[2]
    out = torch.empty(B, M, N, dtype=out_dtype or a.dtype, device=a.device)
    x = bias.expand(B, M, N) if bias is not None else out
    upcast = interpreting() and a.dtype != torch.float32
    grid = (triton.cdiv(M, 64), triton.cdiv(N, 64), B)
    _bmm_kernel[grid](
        a, b, out, x, M, N, K, *a.stride(), *b.stride(), *out.stride(), *x.stride(), float(alpha), float(beta),
        HAS_BIAS=bias is not None, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, UPCAST=upcast,
        IEEE=a.dtype == torch.float32 or interpreting(), num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def row_reduce(x: torch.Tensor, keepdim: bool, mean: bool) -> torch.Tensor:
    """Sum (or mean) over the last dimension, one program per row in a fixed order."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    _row_reduce_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), MEAN=mean, BLOCK=256)
    shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
    return out.view(shape)


class BatchInvariantOps(TorchDispatchMode):
    """Route matmuls (``aten.linear`` included: on CUDA it reaches a dispatch mode whole) and
    last-dimension means/sums to the fixed-order kernels above."""

    def __enter__(self):
        self._token = INVARIANT.set(True)
        return super().__enter__()

    def __exit__(self, *exc):
        INVARIANT.reset(self._token)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten.linear.default and _ours(*args[:2]) and (len(args) < 3 or args[2] is None or _ours(args[2])):
            x, weight = args[0], args[1]  # seen as one op on CUDA: not decomposed into mm
            bias = args[2] if len(args) > 2 else None
            out = bmm(x.reshape(-1, x.shape[-1])[None], weight.t()[None], bias)[0]
            return out.view(*x.shape[:-1], weight.shape[0])
        if func is aten.matmul.default and _ours(*args) and args[0].dim() == args[1].dim() == 3:
            return bmm(args[0], args[1])
        if func is aten.mm.default and _ours(*args):
            return bmm(args[0][None], args[1][None])[0]
        if func is aten.bmm.default and _ours(*args):
            return bmm(args[0], args[1])
        if func is aten.addmm.default and _ours(*args[:3]):
            bias, m1, m2 = args[:3]
            return bmm(
                m1[None],
                m2[None],
                bias[None] if bias.dim() == 2 else bias,
                kwargs.get("beta", 1),
                kwargs.get("alpha", 1),
            )[0]
        if func in (aten.mean.dim, aten.sum.dim_IntList) and _ours(args[0]) and not kwargs.get("dtype"):
            x, dims = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            if dims is not None and len(dims) == 1 and dims[0] % x.dim() == x.dim() - 1 and x.numel():
                return row_reduce(x, keepdim, mean=func is aten.mean.dim)
        return func(*args, **kwargs)


def _ours(*tensors) -> bool:
    return (
        all(isinstance(t, torch.Tensor) and t.dtype in FLOATS and (t.is_cuda or interpreting()) for t in tensors)
        and len({t.dtype for t in tensors}) == 1
    )
