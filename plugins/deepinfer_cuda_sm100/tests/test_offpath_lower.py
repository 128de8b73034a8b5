"""The paged-attention kernel lowers to SM90 machine code at shapes the interpreter accepts but
the GPU may not: heads narrower than a 16-wide ``tl.dot`` (4, 8 and 12 channels; before the
kernel padded them it failed to compile for the GPU while passing every interpreter test), and
DeepSeek-V3's 128-head MLA, whose launches must fit an H200's shared memory (before head chunks
a bf16 split-KV decode needed 256 KiB and failed on the H200 with OutOfResources; float32 451
KiB). Triton's ahead-of-time compile needs no GPU (see test_v4_kernels_lower.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_cuda_sm100.kernels import lowering  # noqa: E402

CHILD = r"""
from deepinfer_cuda_sm100.kernels.lowering import lower
from deepinfer_cuda_sm100.kernels import paged_attention as pa

fn = pa._paged_attention_kernel
for head_dim, dt, qlen in ((4, "fp32", 64), (8, "bf16", 1), (12, "fp32", 1)):
    cfg = pa.choose_config(2, head_dim, qlen, 1, 4096, False)
    da, bdb, db = pa.head_split(head_dim)
    types = dict(q_ptr="*" + dt, cache_ptr="*" + dt, out_ptr="*" + dt, lse_ptr="*fp32", bt_ptr="*i32", qsl_ptr="*i32",
                 seqlen_ptr="*i32", scale="fp32")
    consts = dict(G=2, TPT=max(1, cfg.block_m // 2), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DA=da,
                  DA_OK=min(da, head_dim), BLOCK_DB=bdb, DB=db, BLOCK_DV=16, DV=head_dim, V_PLANE=1, HAS_WINDOW=False,
                  SPLIT=cfg.num_splits > 1, IEEE=dt == "fp32", UPCAST=False)
    lower(fn, types, consts, 90, cfg.num_warps, cfg.num_stages)
    print("d%d" % head_dim)
"""


def test_narrow_heads_compile_for_sm90():
    if not lowering.supported():
        pytest.skip(lowering.UNSUPPORTED)
    out = lowering.run_script(CHILD, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["d4", "d8", "d12"]


WIDE = r"""
from deepinfer_cuda_sm100.kernels.lowering import lower
from deepinfer_cuda_sm100.kernels import paged_attention as pa

fn = pa._paged_attention_kernel
H200_SHARED = 232448  # bytes per block (opt-in maximum), as Triton reported it on the H200
for dt, size, qlen, R in (("bf16", 2, 1, 4), ("bf16", 2, 512, 1), ("fp32", 4, 1, 4)):
    full = pa.choose_config(128, 576, qlen, R, 8192, False)  # as paged_attention decides
    heads = pa.head_chunk(128, 576, 512, size, full.num_splits > 1)
    cfg = pa.choose_config(heads, 576, qlen, R, 8192, False) if heads < 128 else full
    split = cfg.num_splits > 1
    da, bdb, db = pa.head_split(576)
    types = dict(q_ptr="*" + dt, cache_ptr="*" + dt, out_ptr="*fp32" if split else "*" + dt, lse_ptr="*fp32",
                 bt_ptr="*i32", qsl_ptr="*i32", seqlen_ptr="*i32", scale="fp32")
    consts = dict(G=heads, TPT=max(1, cfg.block_m // heads), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DA=da, DA_OK=da,
                  BLOCK_DB=bdb, DB=db, BLOCK_DV=512, DV=512, V_PLANE=0, HAS_WINDOW=False, SPLIT=split,
                  IEEE=dt == "fp32", UPCAST=False)
    kernel = lower(fn, types, consts, 90, cfg.num_warps, cfg.num_stages)
    assert kernel.metadata.shared <= H200_SHARED, (dt, qlen, heads, cfg, kernel.metadata.shared)
    print("%s-q%d-%dheads-%s" % (dt, qlen, heads, "split" if split else "whole"))
"""


def test_deepseek_v3_mla_launches_fit_h200_shared_memory():
    if not lowering.supported():
        pytest.skip(lowering.UNSUPPORTED)
    out = lowering.run_script(WIDE, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["bf16-q1-64heads-split", "bf16-q512-128heads-whole", "fp32-q1-16heads-split"]
