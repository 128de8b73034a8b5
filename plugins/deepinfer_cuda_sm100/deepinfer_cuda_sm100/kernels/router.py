"""DeepSeek-V3's router logits in one launch: ``x [T, D]`` times the float32 router weight
``[E, D]`` -> float32 ``[T, E]``; a GEMV for decode batches (up to ``ROUTER_ROWS`` tokens), a
tiled GEMM on the tensor cores for prefill-sized batches.

Why: the reference ``F.linear(x.float(), weight.float())`` is a cast kernel plus cuBLAS's
float32 GEMV (two kernels at one row): three launches a MoE layer, 0.043 ms of a 1-request
V3-mini step on an H200 (profile: cast 0.016, GEMV 0.027). Products and sums are float32, as
the reference's (only the order of the sums differs). Larger batches keep the reference: each
program reads its expert rows once per token (from L2 after the first), which only pays while
tokens are few.

Prefill (``ROUTER_TILE_ROWS`` bf16 rows and more): the reference is a float32 copy of the whole
hidden state plus a float32 FFMA GEMM (H200, V3-mini 64 x 512 prefill: 0.20 + 0.23 ms a MoE
layer, 3.0 ms of the 67 ms of kernels; benchmarks/kernels/router_gemm.py: 0.418 ms vs 0.070 at 32,768
tokens, 0.117 vs 0.041 at 8,192, even at 2,048, where the reference's 0.042 ms is bound by
launches and the kernel by its 32-step loop over D, so smaller batches keep torch's). The tiled
kernel reads the bf16 rows once and splits each float32 weight tile in registers into three
bf16 parts (``hi + mid + lo`` holds the 24 significant bits), multiplying each on the tensor
cores with float32 accumulation: every bf16 x bf16 product is exact in float32, so the result
is the float32 product up to the order of the sums and the weight's last bit, like the
reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import interpreting
from .pdl import gdc_enter, launch_kw

ROUTER_ROWS = 64  # tokens up to which the kernel replaces the cast + float32 GEMM
ROUTER_TILE_ROWS = 4096  # bf16 tokens from which the tiled tensor-core kernel replaces them
BLOCK_E = 2
BLOCK_D = 1024


@triton.jit
def _router_logits_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    E,
    D,
    stride_xt,
    stride_we,
    stride_ot,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (expert block, token): BLOCK_E logits of one token."""
    gdc_enter(PDL)
    re = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.program_id(1).to(tl.int64)
    e_ok = re < E
    acc = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        d_ok = rd < D
        x = tl.load(x_ptr + t * stride_xt + rd, mask=d_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + re.to(tl.int64)[:, None] * stride_we + rd[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0
        )
        acc += w * x[None, :]
    tl.store(out_ptr + t * stride_ot + re, tl.sum(acc, axis=1), mask=e_ok)


@triton.jit
def _router_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    T,
    E,
    D,
    stride_xt,
    stride_we,
    stride_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (token block, expert block): ``x @ w.T`` with the float32 weight tile split into
    three bf16 parts, each multiplied exactly and accumulated in float32. ``UPCAST``: the parts
    multiplied as float32 (Triton's interpreter, whose bf16 ``tl.dot`` is wrong)."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    re = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    t_ok, e_ok = rt < T, re < E
    x_rows = x_ptr + rt.to(tl.int64)[:, None] * stride_xt
    w_cols = w_ptr + re.to(tl.int64)[None, :] * stride_we
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        d_ok = rd < D
        x = tl.load(x_rows + rd[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_cols + rd[:, None], mask=e_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_E] float32
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)  # exact: w and hi share the leading bits
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        if UPCAST:
            xf = x.to(tl.float32)
            acc = tl.dot(xf, hi.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, mid.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, lo.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, hi, acc)
            acc = tl.dot(x, mid, acc)
            acc = tl.dot(x, lo, acc)
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_ot + re[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


def router_gemm(
    x: torch.Tensor, weight: torch.Tensor, block_t: int | None = None, num_warps: int = 4, num_stages: int = 3
) -> torch.Tensor:
    """The tiled kernel for bf16 rows ``x [T, D]`` and a float32 weight ``[E, D]`` (both with a
    contiguous last dimension) -> float32 ``[T, E]``. ``block_t`` default: 64-token blocks below
    16,384 tokens (more programs: 0.041 vs 0.051 ms at 8,192), 128 from there (0.070 vs 0.097
    ms at 32,768; router_gemm.py on an H200)."""
    T, D = x.shape
    block_t = block_t or (128 if T >= 16384 else 64)
    E = weight.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    block_e = max(16, min(64, triton.next_power_of_2(E)))  # tl.dot needs 16+ columns
    grid = (triton.cdiv(T, block_t), triton.cdiv(E, block_e))
    _router_gemm_kernel[grid](
        x, weight, out, T, E, D, x.stride(0), weight.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_D=64, UPCAST=interpreting(), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x.float(), weight.float())`` for 1 to ROUTER_ROWS contiguous rows and a float32
    weight, and for ROUTER_TILE_ROWS or more bf16 rows; other inputs take that torch expression."""
    T, D = x.shape
    plain = weight.dtype == torch.float32 and x.stride(-1) == 1 and weight.stride(-1) == 1
    if plain and T >= ROUTER_TILE_ROWS and x.dtype == torch.bfloat16:
        return router_gemm(x, weight)
    if not (0 < T <= ROUTER_ROWS) or not plain:
        return torch.nn.functional.linear(x.float(), weight.float())
    E = weight.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    # 17-64 rows: 4 experts a program on 2 warps (benchmarks/kernels/decode64_sweep.py, H200, 64 rows x 64
    # experts x 2048: 0.0039 ms vs 0.0057 for the 1-16 row launch and 0.0109 for the cast + cuBLAS's
    # float32 GEMM, which in the 64-request decode graph was 3 kernels of ~11 us a MoE layer)
    be, warps = (BLOCK_E, 4) if T <= 16 else (4, 2)
    _router_logits_kernel[(triton.cdiv(E, be), T)](
        x,
        weight,
        out,
        E,
        D,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_E=be,
        BLOCK_D=BLOCK_D,
        **launch_kw(x),
        num_warps=warps,
    )
    return out
