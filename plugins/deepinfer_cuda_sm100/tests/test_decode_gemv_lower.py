"""The decode GEMV kernels (dense FP8 GEMV, the 16-bit GEMV (dense and per-head), the MoE's
per-row GEMVs with and without the shared expert's row, on 16-bit, FP8 and MXFP4 experts, the
router logits) lower to machine
code for SM90 (H100/H200) and SM100 (B200) at DeepSeek-V3's shapes: Triton's ahead-of-time
compile with an explicit target needs no GPU, so CI, which runs the kernels only in the
interpreter, also proves they compile (the interpreter accepts code the compiler rejects, e.g.
branches yielding different types)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_cuda_sm100.kernels import lowering  # noqa: E402

CHILD = r"""
from deepinfer_cuda_sm100.kernels.lowering import lower
from deepinfer_cuda_sm100.kernels import bf16_gemv, fp8_gemv, moe_gemv, router

for arch in (90, 100):
    for rows, fixup in ((1, True), (2, False)):
        types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*fp32" if fixup else "*bf16",
                 "final_ptr": "*bf16", "cnt_ptr": "*i32"}
        lower(fp8_gemv._fp8_gemv_kernel, types, dict(ROWS=rows, BLOCK_N=16, GROUPS=8, UPCAST=False, FIXUP=fixup),
              arch, 8)
    for fp8, w in ((True, "*fp8e4nv"), (False, "*bf16")):
        for slots in (7,):  # the shared expert's row included (6: the same code, one branch never taken)
            common = {"w_ptr": w, "sh_w_ptr": w, "s_ptr": "*fp32", "sh_s_ptr": "*fp32", "ids_ptr": "*i64"}
            lower(moe_gemv._gate_up_gemv_kernel, dict(common, x_ptr="*bf16", act_ptr="*bf16", limit="fp32"),
                  dict(BLOCK_N=16, GROUPS=4 if fp8 else 2, SLOTS=slots, HAS_LIMIT=False, FP8=fp8, UPCAST=False),
                  arch, 4)
            lower(moe_gemv._down_gemv_kernel, dict(common, h_ptr="*bf16", weights_ptr="*fp32", out_ptr="*fp32"),
                  dict(BLOCK_N=16, GROUPS=4 if fp8 else 2, SLOTS=slots, FP8=fp8, UPCAST=False), arch, 4)
    # MXFP4 experts (uint8 e2m1 pairs + UE8M0 bytes, decoded in the kernel; V4's routed experts)
    common = {"w_ptr": "*u8", "sh_w_ptr": "*u8", "s_ptr": "*u8", "sh_s_ptr": "*u8", "ids_ptr": "*i64"}
    lower(moe_gemv._gate_up_gemv_kernel, dict(common, x_ptr="*bf16", act_ptr="*bf16", limit="fp32"),
          dict(BLOCK_N=16, GROUPS=2, SLOTS=6, HAS_LIMIT=True, FP8=False, UPCAST=False, MXFP4=True), arch, 4)
    lower(moe_gemv._down_gemv_kernel, dict(common, h_ptr="*bf16", weights_ptr="*fp32", out_ptr="*fp32"),
          dict(BLOCK_N=16, GROUPS=2, SLOTS=6, FP8=False, UPCAST=False, MXFP4=True), arch, 4)
    for rows, fixup, bn, bk, even, norm in ((1, True, 16, 512, True, False), (2, False, 16, 512, False, True),
                                            (1, False, 2, 1024, True, True), (1, False, 64, 128, True, False)):
        types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32" if fixup else "*bf16", "nw_ptr": "*bf16",
                 "eps": "fp32", "final_ptr": "*bf16", "cnt_ptr": "*i32"}
        lower(bf16_gemv._gemv_kernel, types,
              dict(ROWS=rows, BLOCK_N=bn, BLOCK_K=bk, EVEN_N=even, EVEN_K=even, FIXUP=fixup, NORM=norm),
              arch, 8 if bn * bk >= 2048 else 4)
    lower(router._router_logits_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32"},
          dict(BLOCK_E=2, BLOCK_D=1024), arch, 4)
    print("sm%d" % arch)
"""


def test_decode_gemv_kernels_compile_for_sm90_and_sm100():
    if not lowering.supported():
        pytest.skip(lowering.UNSUPPORTED)
    out = lowering.run_script(CHILD, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["sm90", "sm100"]
