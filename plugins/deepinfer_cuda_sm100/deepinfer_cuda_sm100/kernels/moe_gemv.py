"""MoE experts for a few decode rows: one GEMV program per (token, choice) row and column slab,
reading that row's expert straight from the routing ids.

Why: at one request the six chosen experts are a pure weight read, and the grouped GEMMs of
``fused_moe`` (expert-sorted rows padded to 16-row MMA tiles, 15 of them padding, after an
alignment launch) read V3-mini's FP8 experts at ~1 TB/s (H200 profile: gate/up 0.161 ms + down
0.101 ms for 7 layers) against ~4 TB/s for a plain copy. Here no alignment is needed (a row's
expert is its id), each program streams ``[BLOCK_N, GROUPS * 128]`` weight slabs with 16-byte
loads and multiplies on the CUDA cores.

Arithmetic as ``fused_moe``'s: FP8 experts with 16-bit activations quantize them per row and 128
channels (e4m3, scale = amax / 448) and scale each group's exact products; 16-bit experts
multiply in float32. gate and up are rounded to the activation dtype, SiLU-and-mul rounded, the
down product kept float32 times the routing weight, a token's k rows summed by
``fused_moe``'s fixed-order row sum. Only float32 sum orders differ from the tiled kernels; a
row's result depends on that row alone, but the tiled path handles larger batches, so a
batch-invariant forward (an explicit tiling) never comes here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_elementwise import _round
from .gemm_parts import _quant_rows
from .mxfp4 import _mxfp4_tile
from .paged_attention import interpreting
from .pdl import gdc_enter, launch_kw

MOE_GEMV_ROWS = 8  # (token, choice) rows up to which the GEMVs replace the grouped GEMMs
BLOCK_N = 16  # weight rows per program (gate/up: 16 of each)


def _groups(weight: torch.Tensor) -> int:
    """128-wide K groups per step: 8 KiB slabs of FP8 (16 x 512), 8 KiB of 16-bit (16 x 256)."""
    return 4 if weight.element_size() == 1 else 2


@triton.jit
def _dot_rows(w, a, s_w, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """One K step of one row: ``w [BLOCK_N, GROUPS, 128]`` (float32 values) against the row's
    ``a [GROUPS, 128]`` (float32) -> ``[BLOCK_N]``; FP8: ``a`` quantized per group, each
    group's exact products times the row's and the weight tile's (``s_w [BLOCK_N, GROUPS]``)
    scales."""
    if FP8:
        q, sa = _quant_rows(a, UPCAST)
        dots = tl.sum(w * q.to(tl.float32)[None, :, :], axis=2)
        return tl.sum(dots * s_w * sa[None, :], axis=1)
    return tl.sum(tl.sum(w * a[None, :, :], axis=2), axis=1)


@triton.jit
def _expert_base(j, ids_ptr, w_ptr, s_ptr, sh_w_ptr, sh_s_ptr, top_k, stride_we, stride_se, SLOTS: tl.constexpr):
    """Row j = (token j // SLOTS, slot j % SLOTS): slots below top_k are the token's routed
    choices (weight and scale bases of expert ids[token, slot]); a last slot (SLOTS = top_k + 1)
    is the shared expert. -> (token, flat routed index or -1, weight base, scale base)."""
    t = j // SLOTS
    c = j % SLOTS
    flat = t * top_k + c
    w_base = sh_w_ptr
    s_base = sh_s_ptr
    if c < top_k:
        e = tl.load(ids_ptr + flat).to(tl.int64)
        w_base = w_ptr + e * stride_we
        s_base = s_ptr + e * stride_se
    else:
        flat = flat * 0 - 1
    return t, flat, w_base, s_base


@triton.jit
def _gate_up_row(
    x_row, w_base, s_base, rn, n_ok, D, I, stride_wn, stride_sn,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, MXFP4: tl.constexpr,
):  # fmt: skip
    """One row's gate and up slabs ``[BLOCK_N]`` each (float32 sums) from the expert at
    ``w_base`` / ``s_base`` in its format: MXFP4, FP8 with 128 x 128 scales, or 16-bit."""
    rg = tl.arange(0, GROUPS)
    rc = tl.arange(0, 128)
    g_rows = w_base + rn.to(tl.int64)[:, None, None] * stride_wn
    u_rows = g_rows + I * stride_wn
    sg_rows = s_base + (rn // 128)[:, None] * stride_sn
    su_rows = s_base + ((I + rn) // 128)[:, None] * stride_sn
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, D, GROUPS * 128):
        rk = k0 + rg[:, None] * 128 + rc[None, :]
        k_ok = rk < D
        w_ok = n_ok[:, None, None] & k_ok[None, :, :]
        if MXFP4:  # packed e2m1 pairs decoded in place (kernels/mxfp4.py)
            rn64 = rn.to(tl.int64)
            wg = _mxfp4_tile(w_base, s_base, rn64, n_ok, k0, D, stride_wn, stride_sn, BLOCK_N, GROUPS * 128)
            wu = _mxfp4_tile(w_base, s_base, rn64 + I, n_ok, k0, D, stride_wn, stride_sn, BLOCK_N, GROUPS * 128)
            wg = tl.reshape(wg, [BLOCK_N, GROUPS, 128])
            wu = tl.reshape(wu, [BLOCK_N, GROUPS, 128])
        else:
            wg = tl.load(g_rows + rk[None, :, :], mask=w_ok, other=0.0).to(tl.float32)
            wu = tl.load(u_rows + rk[None, :, :], mask=w_ok, other=0.0).to(tl.float32)
        a = tl.load(x_row + rk, mask=k_ok, other=0.0).to(tl.float32)
        sg = sg_rows  # unused without FP8
        su = su_rows
        if FP8:
            s_ok = n_ok[:, None] & (k0 + rg * 128 < D)[None, :]
            sg = tl.load(sg_rows + (k0 // 128 + rg)[None, :], mask=s_ok, other=0.0)
            su = tl.load(su_rows + (k0 // 128 + rg)[None, :], mask=s_ok, other=0.0)
        acc_g += _dot_rows(wg, a, sg, FP8, UPCAST)
        acc_u += _dot_rows(wu, a, su, FP8, UPCAST)
    return acc_g, acc_u


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    act_ptr,
    sh_w_ptr,
    sh_s_ptr,
    top_k,
    D,
    I,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_at,
    limit,
    sh_stride_wn,
    sh_stride_sn,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    SLOTS: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
    MXFP4: tl.constexpr = False,
    SH_FP8: tl.constexpr = False,
):
    """Program (j, n): row j (``_expert_base``), act[j, n-slab] = silu(gate) * up. ``SH_FP8``:
    the routed experts are MXFP4 and the shared expert (the last slot) FP8 with its own strides
    (DeepSeek-V4's release), each row decoded in its own format."""
    gdc_enter(PDL)
    j = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    t = j // SLOTS
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    if SH_FP8:
        c = j % SLOTS
        if c < top_k:
            e = tl.load(ids_ptr + t * top_k + c).to(tl.int64)
            acc_g, acc_u = _gate_up_row(
                x_row, w_ptr + e * stride_we, s_ptr + e * stride_se, rn, n_ok, D, I, stride_wn, stride_sn,
                BLOCK_N, GROUPS, False, UPCAST, True,
            )  # fmt: skip
        else:
            acc_g, acc_u = _gate_up_row(
                x_row, sh_w_ptr, sh_s_ptr, rn, n_ok, D, I, sh_stride_wn, sh_stride_sn, BLOCK_N, GROUPS, True, UPCAST,
                False,
            )  # fmt: skip
    else:
        _, _, w_base, s_base = _expert_base(
            j, ids_ptr, w_ptr, s_ptr, sh_w_ptr, sh_s_ptr, top_k, stride_we, stride_se, SLOTS
        )
        acc_g, acc_u = _gate_up_row(
            x_row, w_base, s_base, rn, n_ok, D, I, stride_wn, stride_sn, BLOCK_N, GROUPS, FP8, UPCAST, MXFP4
        )
    a_ty = act_ptr.dtype.element_ty
    gate = _round(acc_g, a_ty)  # rounded to the activation dtype first, as the reference does
    up = _round(acc_u, a_ty)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = _round(gate / (1.0 + tl.exp(-gate)) * up, a_ty)
    tl.store(act_ptr + j.to(tl.int64) * stride_at + rn, act.to(a_ty), mask=n_ok)


@triton.jit
def _down_row(
    h_row, w_base, s_base, rn, n_ok, I, stride_wn, stride_sn,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr, MXFP4: tl.constexpr,
):  # fmt: skip
    """One row's down-projection slab ``[BLOCK_N]`` (float32) of ``h_row`` [I] through the expert
    at ``w_base`` / ``s_base`` in its format."""
    rg = tl.arange(0, GROUPS)
    rc = tl.arange(0, 128)
    w_rows = w_base + rn.to(tl.int64)[:, None, None] * stride_wn
    s_rows = s_base + (rn // 128)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, I, GROUPS * 128):
        rk = k0 + rg[:, None] * 128 + rc[None, :]
        k_ok = rk < I
        if MXFP4:
            w = _mxfp4_tile(w_base, s_base, rn.to(tl.int64), n_ok, k0, I, stride_wn, stride_sn, BLOCK_N, GROUPS * 128)
            w = tl.reshape(w, [BLOCK_N, GROUPS, 128])
        else:
            w = tl.load(w_rows + rk[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0)
            w = w.to(tl.float32)
        a = tl.load(h_row + rk, mask=k_ok, other=0.0).to(tl.float32)
        s = s_rows
        if FP8:
            s = tl.load(
                s_rows + (k0 // 128 + rg)[None, :], mask=n_ok[:, None] & (k0 + rg * 128 < I)[None, :], other=0.0
            )
        acc += _dot_rows(w, a, s, FP8, UPCAST)
    return acc


@triton.jit
def _down_gemv_kernel(
    h_ptr,
    w_ptr,
    s_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    sh_w_ptr,
    sh_s_ptr,
    top_k,
    D,
    I,
    stride_ht,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    sh_stride_wn,
    sh_stride_sn,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    SLOTS: tl.constexpr,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
    MXFP4: tl.constexpr = False,
    SH_FP8: tl.constexpr = False,
):
    """Program (j, n): out[j, n-slab] = routing weight (1 for the shared expert) * act[j] @
    W_down[n-slab]^T, float32 (``SH_FP8`` as the gate/up kernel's)."""
    gdc_enter(PDL)
    j = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < D
    h_row = h_ptr + j.to(tl.int64) * stride_ht
    if SH_FP8:
        t = j // SLOTS
        c = j % SLOTS
        flat = t * top_k + c
        if c < top_k:
            e = tl.load(ids_ptr + flat).to(tl.int64)
            acc = _down_row(
                h_row, w_ptr + e * stride_we, s_ptr + e * stride_se, rn, n_ok, I, stride_wn, stride_sn,
                BLOCK_N, GROUPS, False, UPCAST, True,
            )  # fmt: skip
        else:
            flat = flat * 0 - 1
            acc = _down_row(
                h_row, sh_w_ptr, sh_s_ptr, rn, n_ok, I, sh_stride_wn, sh_stride_sn, BLOCK_N, GROUPS, True, UPCAST, False
            )
    else:
        t, flat, w_base, s_base = _expert_base(
            j, ids_ptr, w_ptr, s_ptr, sh_w_ptr, sh_s_ptr, top_k, stride_we, stride_se, SLOTS
        )
        acc = _down_row(h_row, w_base, s_base, rn, n_ok, I, stride_wn, stride_sn, BLOCK_N, GROUPS, FP8, UPCAST, MXFP4)
    weight = tl.where(flat < 0, 1.0, tl.load(weights_ptr + tl.maximum(flat, 0)))  # the shared expert: 1
    tl.store(out_ptr + j.to(tl.int64) * stride_ot + rn, acc * weight, mask=n_ok)


def moe_gemv(
    hidden, gate_up, down, topk_ids, topk_weights, swiglu_limit, gate_up_scale, down_scale, shared=None
) -> torch.Tensor:
    """The routed rows ``[T * k, D]`` (float32, routing weight applied) for 16-bit ``hidden``;
    with ``shared`` (an ``ExpertWeights`` of one expert, shaped as one of ``gate_up`` / ``down``,
    checked by :func:`shared_fits`) ``[T * (k + 1), D]``, each token's last row its shared
    expert's output. uint8 experts are MXFP4 (``fused_moe``'s layout), decoded per slab and
    multiplied in float32 as 16-bit experts are; with MXFP4 routed experts the shared expert may
    be FP8 (DeepSeek-V4's release), its row multiplied as an FP8 expert's. ``swiglu_limit``
    clamps every row, the shared expert's too. ``fused_moe`` checks the shapes and sums a
    token's rows."""
    T, D = hidden.shape
    _, two_i, _ = gate_up.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    slots = k + (shared is not None)
    rows = T * slots
    mxfp4 = gate_up.dtype == torch.uint8
    scaled = gate_up_scale is not None
    fp8 = scaled and not mxfp4
    sh_fp8 = mxfp4 and shared is not None and shared.gate_up.dtype == torch.float8_e4m3fn
    ids = topk_ids.reshape(-1)
    gs = gate_up_scale if scaled else gate_up  # any tensor: unused without scales
    ds = down_scale if scaled else down
    sh = shared if shared is not None else None
    sh_gu, sh_d = (sh.gate_up, sh.down) if sh is not None else (gate_up, down)
    sh_gs, sh_ds = (sh.gate_up_scale, sh.down_scale) if sh is not None and scaled else (gs, ds)
    # the shared expert's own row strides where its format differs (else the routed ones serve)
    sh_gu_strides = (sh_gu.stride(1), sh_gs.stride(1)) if sh_fp8 else (0, 0)
    sh_d_strides = (sh_d.stride(1), sh_ds.stride(1)) if sh_fp8 else (0, 0)
    upcast = interpreting()
    act = torch.empty(rows, inter, dtype=hidden.dtype, device=hidden.device)
    _gate_up_gemv_kernel[(rows, triton.cdiv(inter, BLOCK_N))](
        hidden, gate_up, gs, ids, act, sh_gu, sh_gs, k, D, inter,
        hidden.stride(0), gate_up.stride(0), gate_up.stride(1), gs.stride(0) if scaled else 0,
        gs.stride(1) if scaled else 0, act.stride(0), float(swiglu_limit or 0.0), *sh_gu_strides,
        BLOCK_N=BLOCK_N, GROUPS=_groups(gate_up), SLOTS=slots, HAS_LIMIT=swiglu_limit is not None, FP8=fp8,
        UPCAST=upcast, MXFP4=mxfp4, SH_FP8=sh_fp8, **launch_kw(hidden), num_warps=4,
    )  # fmt: skip
    out = torch.empty(rows, D, dtype=torch.float32, device=hidden.device)
    _down_gemv_kernel[(rows, triton.cdiv(D, BLOCK_N))](
        act, down, ds, ids, topk_weights.reshape(-1).float().contiguous(), out, sh_d, sh_ds, k, D, inter,
        act.stride(0), down.stride(0), down.stride(1), ds.stride(0) if scaled else 0, ds.stride(1) if scaled else 0,
        out.stride(0), *sh_d_strides, BLOCK_N=BLOCK_N, GROUPS=_groups(down), SLOTS=slots, FP8=fp8, UPCAST=upcast,
        MXFP4=mxfp4, SH_FP8=sh_fp8, **launch_kw(hidden), num_warps=4,
    )  # fmt: skip
    return out


def shared_fits(shared, gate_up, down, gate_up_scale, down_scale) -> bool:
    """The shared expert can ride along as one more row: one expert ``[1, 2I, D]`` / ``[1, D, I]``
    of the routed experts' dtype, width and strides (and FP8 scale grids alike), so the kernels
    address it as they address a routed expert; or, with MXFP4 routed experts, an FP8 one with
    its 128 x 128 scale grids (:func:`_fp8_beside_mxfp4`)."""
    if shared is None or shared.gate_up.shape[0] != 1 or shared.down.shape[0] != 1:
        return False
    if gate_up.dtype == torch.uint8 and shared.gate_up.dtype == torch.float8_e4m3fn:
        return _fp8_beside_mxfp4(shared, gate_up, down)
    same = shared.gate_up.shape[1:] == gate_up.shape[1:] and shared.down.shape[1:] == down.shape[1:]
    same = same and shared.gate_up.dtype == gate_up.dtype and shared.down.dtype == down.dtype
    same = (
        same and shared.gate_up.stride()[1:] == gate_up.stride()[1:] and shared.down.stride()[1:] == down.stride()[1:]
    )
    if gate_up_scale is None:
        return same and shared.gate_up_scale is None
    scales = shared.gate_up_scale is not None and shared.down_scale is not None
    return (
        same and scales and shared.gate_up_scale.shape[1:] == gate_up_scale.shape[1:]
        and shared.down_scale.shape[1:] == down_scale.shape[1:]
        and shared.gate_up_scale.stride()[1:] == gate_up_scale.stride()[1:]
        and shared.down_scale.stride()[1:] == down_scale.stride()[1:]
    )  # fmt: skip


def _fp8_beside_mxfp4(shared, gate_up, down) -> bool:
    """An FP8 shared expert (float8 e4m3 ``[1, 2I, D]`` / ``[1, D, I]``, float32 scales per 128 x
    128 tile, contiguous rows) of the packed MXFP4 experts' sizes (``[E, 2I, D/2]`` /
    ``[E, D, I/2]``), I and D multiples of 128."""
    two_i, half_d = gate_up.shape[1], gate_up.shape[2]
    D, half_i = down.shape[1], down.shape[2]
    inter = two_i // 2
    gu, dn, gs, ds = shared.gate_up, shared.down, shared.gate_up_scale, shared.down_scale
    if gs is None or ds is None or dn.dtype != torch.float8_e4m3fn or inter % 128 or D % 128:
        return False
    if gu.shape[1:] != (two_i, 2 * half_d) or dn.shape[1:] != (D, 2 * half_i) or 2 * half_d != D or 2 * half_i != inter:
        return False
    if gu.stride(-1) != 1 or dn.stride(-1) != 1 or gs.dtype != torch.float32 or ds.dtype != torch.float32:
        return False
    return gs.shape[1:] == (two_i // 128, D // 128) and ds.shape[1:] == (D // 128, inter // 128)
