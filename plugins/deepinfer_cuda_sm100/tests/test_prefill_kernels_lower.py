"""The prefill kernels chosen on the H200 lower to machine code for SM90 (H100/H200) and SM100
(B200) at DeepSeek-V3's shapes, with no GPU: the router's tiled GEMM (the weight split into
three bf16 parts) and the fused MoE's gate/up and down GEMMs with their tiles fetched through
tensor descriptors (``MoEConfig.tma``); likewise the decode tiles (``DECODE_GATE_UP`` /
``DECODE_DOWN``) and the alignment kernel (a program per expert). The interpreter, which runs them in CI, accepts code
the compiler rejects (and launches that overflow shared memory), so each must also compile and
fit an H200's 227 KiB of shared memory per block."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_cuda_sm100.kernels import lowering  # noqa: E402

CHILD = r"""
from deepinfer_cuda_sm100.kernels.fused_moe import (
    DECODE_DOWN, DECODE_GATE_UP, _align_kernel, _down_kernel, _gate_up_kernel, choose_config, choose_down_config,
)
from deepinfer_cuda_sm100.kernels.lowering import lower
from deepinfer_cuda_sm100.kernels.router import _router_gemm_kernel

gu, dn = choose_config(196608, 64), choose_down_config(196608, 64)  # V3-mini's 64 x 512 prefill, top-6
assert gu.tma and dn.tma
flags = dict(UPCAST=False, IEEE=False, FP8=False, QUANT_A=False, PREQ=False, TMA=True)
ptrs = {n: "*i32" for n in ("sorted_ptr", "expert_ptr", "total_ptr")}
ptrs.update(s_ptr="*fp32", xs_ptr="*fp32", hs_ptr="*fp32", out_ptr="*bf16", limit="fp32")
for arch in (90, 100):
    k = lower(_router_gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32"},
              dict(BLOCK_T=128, BLOCK_E=64, BLOCK_D=64, UPCAST=False), arch, 4, 3)
    sizes = [k.metadata.shared]
    c = gu
    types = dict(ptrs, x_ptr="*bf16", w_ptr="*bf16", w_desc="tensordesc<bf16[%d,%d]>" % (c.block_n, c.block_k))
    k = lower(_gate_up_kernel, types,
              dict(flags, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, HAS_LIMIT=False),
              arch, c.num_warps, c.num_stages)
    sizes.append(k.metadata.shared)
    c = dn
    types = dict(ptrs, h_ptr="*bf16", w_ptr="*bf16", h_desc="tensordesc<bf16[%d,%d]>" % (c.block_m, c.block_k),
                 w_desc="tensordesc<bf16[%d,%d]>" % (c.block_n, c.block_k))
    k = lower(_down_kernel, types,
              dict(flags, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m),
              arch, c.num_warps, c.num_stages)
    sizes.append(k.metadata.shared)
    c = DECODE_GATE_UP  # decode: 16-row tiles, 128-wide K steps, gate/up weights by the copy engine
    types = dict(ptrs, x_ptr="*bf16", w_ptr="*bf16", w_desc="tensordesc<bf16[%d,%d]>" % (c.block_n, c.block_k))
    k = lower(_gate_up_kernel, types,
              dict(flags, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, HAS_LIMIT=False),
              arch, c.num_warps, c.num_stages)
    sizes.append(k.metadata.shared)
    c = DECODE_DOWN
    types = dict(ptrs, h_ptr="*bf16", w_ptr="*bf16", h_desc="*bf16", w_desc="*bf16")
    k = lower(_down_kernel, types,
              dict(flags, TMA=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m),
              arch, c.num_warps, c.num_stages)
    sizes.append(k.metadata.shared)
    for c in (gu, DECODE_GATE_UP):  # MXFP4 experts (uint8 pairs + UE8M0 bytes, no TMA): prefill and decode tiles
        types = dict(ptrs, x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", w_desc="*u8")
        k = lower(_gate_up_kernel, types,
                  dict(flags, TMA=False, MXFP4=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                       GROUP_M=c.group_m, HAS_LIMIT=True), arch, c.num_warps, c.num_stages)
        sizes.append(k.metadata.shared)
    for c in (dn, DECODE_DOWN):
        types = dict(ptrs, h_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", h_desc="*bf16", w_desc="*u8")
        k = lower(_down_kernel, types,
                  dict(flags, TMA=False, MXFP4=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                       GROUP_M=c.group_m), arch, c.num_warps, c.num_stages)
        sizes.append(k.metadata.shared)
    types = {"ids_ptr": "*i64", "sorted_ptr": "*i32", "expert_ptr": "*i32", "total_ptr": "*i32", "counts_ptr": "*i64"}
    lower(_align_kernel, types, dict(BLOCK_M=16, E_P=64, CHUNK=128, FILL=256), arch, 4)
    assert max(sizes) <= 232448, sizes
    print("sm%d" % arch)
"""


def test_prefill_kernels_compile_for_sm90_and_sm100():
    if not lowering.supported():
        pytest.skip(lowering.UNSUPPORTED)
    out = lowering.run_script(CHILD, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["sm90", "sm100"]
