"""The DeepSeek-V4 kernels (attention, ring write, indexer scores, compressor decode step,
hyper-connection mix (with and without hc_pre's split-K partials), projection and merge, V4
norm and rope, sqrt-softplus routing) lower to machine code for SM90 (H100/H200) and SM100
(B200) at V4's shapes (head_dim 512, 16 heads, bf16): Triton's ahead-of-time compile with an
explicit target needs no GPU, so CI, which runs the kernels only in the interpreter, also proves
they compile (the interpreter accepts code that the compiler rejects, e.g. branches yielding
different types).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_cuda_sm100.kernels import lowering  # noqa: E402

CHILD = r"""
from deepinfer_cuda_sm100.kernels.lowering import lower
from deepinfer_cuda_sm100.kernels import (
    v4_attention as va, v4_indexer as vi, v4_compressor as vc, hyper_connection as hc, v4_elementwise as ve,
)

bf = {n: "*bf16" for n in ("q_ptr", "kv_ptr", "ring_ptr", "ent_ptr", "out_ptr")}
bf.update(sel_ptr="*i64", sink_ptr="*fp32", bt_ptr="*i32", qsl_ptr="*i32", seqlen_ptr="*i32", slot_ptr="*i64",
          lse_ptr="*fp32", scale="fp32")
for arch in (90, 100):
    for mode, split in ((0, False), (1, True), (2, False)):
        types = dict(bf, out_ptr="*fp32") if split else bf
        consts = dict(H=16, TPT=1, BLOCK_M=16, BLOCK_N=32, D=512, MODE=mode, SPLIT=split, IEEE=False, UPCAST=False)
        lower(va._v4_attention_kernel, types, consts, arch, 8)
    lower(va._ring_write_kernel,
          {"kv_ptr": "*bf16", "ring_ptr": "*bf16", "qsl_ptr": "*i32", "seqlen_ptr": "*i32", "slot_ptr": "*i64"},
          {"D": 512}, arch, 4)
    lower(vi._index_scores_kernel,
          {"q_ptr": "*bf16", "w_ptr": "*fp32", "ent_ptr": "*bf16", "bt_ptr": "*i32", "qsl_ptr": "*i32",
           "pos_ptr": "*i64", "out_ptr": "*fp32", "scale": "fp32"},
          dict(BLOCK_H=16, BLOCK_N=64, DI=128, BLOCK_R=16, IEEE=False), arch, 4)
    cd = {"new_ptr": "*bf16", "tail_ptr": "*bf16", "slot_ptr": "*i64", "pos_ptr": "*i64", "pb_ptr": "*fp32",
          "normw_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "ent_ptr": "*bf16", "bt_ptr": "*i32",
          "eps": "fp32"}
    # CSA, HCA, indexer
    for ratio, width, dh, overlap in ((4, 1024, 256, True), (128, 512, 256, False), (4, 256, 64, True)):
        lower(vc._compress_decode_kernel, cd, dict(RATIO=ratio, W=width, DH=dh, ROPE2=32, OVERLAP=overlap, BLOCK_R=8),
              arch, 4)
    # hc_mix on a projection row, and (hc_pre) summing split-K partials: V4-mini's 32 slices, V4's 112
    for partial, block_s in ((False, 1), (True, 32), (True, 128)):
        lower(hc._hc_mix_kernel,
              {"mixed_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32", "streams_ptr": "*bf16",
               "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16", "eps": "fp32", "norm_eps": "fp32"},
              dict(HC=4, BLOCK_HC=4, BLOCK_D=1024, PARTIAL=partial, BLOCK_S=block_s), arch, 4)
    lower(hc._hc_project_kernel, {"x_ptr": "*bf16", "fn_ptr": "*fp32", "part_ptr": "*fp32"},
          dict(BLOCK_M=32, BLOCK_K=256), arch, 4)
    lower(hc._hc_merge_kernel,
          {"s_ptr": "*bf16", "o_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16"},
          dict(HC=4, BLOCK_HC=4, BLOCK_D=512), arch, 4)
    from deepinfer_cuda_sm100.kernels import routing
    lower(routing._route_kernel,
          {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "w_ptr": "*fp32", "scaling": "fp32"},
          dict(E_P=64, G=1, TOPK_G=1, K=6, K_P=8, SOFTMAX=False, HAS_BIAS=True, NORMALIZE=True, SQRTSOFTPLUS=True),
          arch, 1)
    lower(ve._v4_rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16", "eps": "fp32"},
          dict(BLOCK=2048), arch, 4)
    for block in (512, 8192):  # the query's head_dim; V4-mini's 4 hyper-connection streams of 2,048 (float32)
        ty = "*bf16" if block == 512 else "*fp32"
        lower(ve._v4_unweighted_rms_norm_kernel, {"x_ptr": ty, "out_ptr": ty, "eps": "fp32"}, dict(BLOCK=block),
              arch, 8 if block >= 4096 else 4)
    for half in (32, 24):  # V4's rope of 64; a rope of 48 (its half not a power of two: a masked block)
        lower(ve._v4_rope_kernel, {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16"},
              dict(NOPE=512 - 2 * half, BLOCK_NOPE=512, HALF=half, BLOCK_HALF=32), arch, 4)
    print("sm%d" % arch)
"""


def test_v4_kernels_compile_for_sm90_and_sm100():
    if not lowering.supported():
        pytest.skip(lowering.UNSUPPORTED)
    out = lowering.run_script(CHILD, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["sm90", "sm100"]
