"""Tensor-level entry point to the native kernels: ``x @ W^T`` with W packed.

Two kernels (kernels.c and kernels_i16.c say how each works): the exact one keeps activations
float32; the integer one rounds them to 16 bits per 32-block and uses exact integer dot products
(``vpmaddwd``), 2-3x faster for one token and 1.2-1.4x from ~16 tokens on (prefill, decode of
many requests), about as fast at 5-12. Its rounding (1/65534 of each block's largest value)
keeps SmolLM2's greedy tokens those of the float32 model (benchmarks/README.md), so by default
every call takes it. :func:`int_rows` says up to how many rows a call does;
``DEEPINFER_LOWBIT_EXACT=1`` (or ``DEEPINFER_LOWBIT_INT_ROWS=0``) keeps every call on the exact
kernel, ``DEEPINFER_LOWBIT_INT_ROWS=4`` the earlier default (int16 for decode of <= 4 requests).

A third kernel (kernels_i8.c) rounds activations to int8 per 32-block for 4-bit weights only,
llama.cpp's way: about 2x the exact kernel's speed from 5 rows on (prefill, decode of many
requests) on an AVX2 CPU, but it moves SmolLM2's logits by ~1.5 against float32 (int16: ~0.01),
so greedy outputs part from the float32 model's after ~12 tokens on average (benchmarks/README.md:
Q4_1 0/16 identical over 128 tokens, as llama.cpp). Hence opt-in: :func:`int8_rows` says from how
many rows it is taken (``DEEPINFER_LOWBIT_INT8_ROWS``, default 0: never); 8-bit weights (Q8_0)
never take it.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from .. import envs
from .formats import KIND_CODE, QuantWeight
from .native import load

DEFAULT_INT_ROWS = (
    1 << 62
)  # every call: the integer kernel is as fast or faster at every row count (benchmarks/README.md)


def int_rows(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> int:
    """Calls with at most this many rows take the integer kernel (0: none). Read when a model is
    built, not per call."""
    return _rows_setting(
        environ, "DEEPINFER_LOWBIT_INT_ROWS", DEFAULT_INT_ROWS, "rows up to which activations are rounded to int16"
    )


DEFAULT_INT8_ROWS = 0  # opt-in (the docstring says why); 1 would send every 4-bit call to it


def int8_rows(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> int:
    """Calls of 4-bit weights with at least this many rows take the int8-activation kernel (0:
    none), whatever :func:`int_rows` says. ``DEEPINFER_LOWBIT_EXACT=1`` turns it off too."""
    return _rows_setting(
        environ,
        "DEEPINFER_LOWBIT_INT8_ROWS",
        DEFAULT_INT8_ROWS,
        "rows from which 4-bit weights meet int8 activations; 0: never",
    )


def _rows_setting(environ: "os._Environ[str] | dict[str, str]", name: str, default: int, meaning: str) -> int:
    """A row-count setting: ``default`` when unset, 0 under ``DEEPINFER_LOWBIT_EXACT=1``, a
    value that is not a whole number >= 0 refused by name."""
    if envs.get("DEEPINFER_LOWBIT_EXACT", environ):
        return 0
    return envs.get(name, environ)  # a whole number >= 0, refused by name otherwise


def kernel_for(M: int, kind: str, max_int_rows: int, min_int8_rows: int) -> str:
    """Which kernel a call of M rows takes: "i8" (opted in), "i16" or "exact" (kernels.c's
    lowbit_gemm chooses the same way)."""
    if kind == "q4" and min_int8_rows > 0 and M >= min_int8_rows:
        return "i8"
    if M <= max_int_rows:
        return "i16"
    return "exact"


def _rows(x: torch.Tensor, w: QuantWeight) -> tuple[torch.Tensor, int, int]:
    """``x`` as the kernels read it (float32, contiguous) with its M and K, checked against ``w``."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    M, K = x.shape
    if w.shape[1] != K:
        raise ValueError(f"weight has K={w.shape[1]}, activations K={K}")
    return x, M, K


def matmul(
    x: torch.Tensor, w: QuantWeight, max_int_rows: int = 0, min_int8_rows: int = 0
) -> torch.Tensor:  # [M, K] x [N, K]^T -> [M, N] float32
    kernels = load()
    if kernels.lib is None:
        raise RuntimeError(f"low-bit kernels unavailable: {kernels.reason}")
    x, M, K = _rows(x, w)
    N = w.qs.shape[0]
    y = torch.empty(M, N)
    m_ptr = w.m.data_ptr() if w.m is not None else None
    which = kernel_for(M, w.kind, max_int_rows, min_int8_rows)
    if which == "i8":
        kernels.lib.gemm_i8_act(
            x.data_ptr(), M, K, w.qs.data_ptr(), w.d.data_ptr(), m_ptr, N, y.data_ptr(), torch.get_num_threads()
        )
        return y
    kernel = kernels.lib.gemm_i16_act if which == "i16" else kernels.lib.gemm_f32_act
    kernel(
        x.data_ptr(),
        M,
        K,
        KIND_CODE[w.kind],
        w.qs.data_ptr(),
        w.d.data_ptr(),
        m_ptr,
        N,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y


def head_argmax(
    x: torch.Tensor,
    w: QuantWeight,
    max_int_rows: int = 0,
    min_int8_rows: int = 0,
    threads: int | None = None,
    screen: "HeadScreen | None" = None,
) -> torch.Tensor | None:
    """The index of the largest logit of each row of ``x @ W^T`` ([M] int64), as
    ``torch.argmax(matmul(x, w, ...), -1)`` gives it, without the [M, N] logits (head.c: the
    same kernel on vocabulary chunks, so every logit has the full head's bits; ties to the lowest
    index). None when a logit is NaN or the kernels are not built: the caller takes the full head.
    ``screen`` (:func:`prepare_screen`): from ``screen.min_rows`` rows on, head_screen.c answers,
    the same indices (int8 logits with a proven error bound pick the candidates, the head's own
    kernel decides among them)."""
    kernels = load()
    if kernels.lib is None or w.kind not in KIND_CODE:
        return None
    x, M, K = _rows(x, w)
    out = torch.empty(M, dtype=torch.int64)
    if M == 0:
        return out
    m_ptr = w.m.data_ptr() if w.m is not None else None
    threads = threads or torch.get_num_threads()
    if screen is not None and M >= screen.min_rows and screen.isa == kernels.isa:
        return screened_head_argmax(x, w, screen, max_int_rows, min_int8_rows, threads)[0]
    failed = kernels.lib.lowbit_head_argmax(
        x.data_ptr(),
        M,
        K,
        KIND_CODE[w.kind],
        w.qs.data_ptr(),
        w.d.data_ptr(),
        m_ptr,
        w.qs.shape[0],
        max_int_rows,
        min_int8_rows,
        threads,
        out.data_ptr(),
    )
    return None if failed else out


# The int8-screened head (head_screen.c) wins from this many rows on (benchmarks/README.md, head5);
# fewer rows keep head.c's, whose int16 pass over the weights costs about as much as the screen's.
SCREEN_MIN_ROWS = 8
# Builds where it wins: vpdpbusd halves the dot-product instructions. The AVX2 build's exact int8
# products (vpsignb, vpmaddubsw, vpmaddwd, vpaddd) take as many as its int16 ones: 0.77x head.c at
# 32 rows. AVX-VNNI (ymm, 16 registers) is not measured: it keeps head.c.
SCREEN_ISAS = ("avx512vnni",)


def screen_pays() -> bool:
    """Whether the engine should screen its q8 greedy head with this build (SCREEN_ISAS)."""
    return load().isa in SCREEN_ISAS


@dataclass(frozen=True)
class HeadScreen:
    """A q8 head repacked for the int8 screen (head_screen.c): ``panel`` [bytes] uint8, 32-byte
    aligned inside; ``arow`` max_j sum_b |d_jb| sum_k |q_jbk| (the overflow guard)."""

    panel: torch.Tensor
    offset: int  # bytes from panel's start to the aligned panel
    arow: float
    isa: str  # the build that checked the weights (the AVX2 one refuses -128)
    min_rows: int = SCREEN_MIN_ROWS

    @property
    def pointer(self) -> int:
        return self.panel.data_ptr() + self.offset


def prepare_screen(w: QuantWeight, min_rows: int = SCREEN_MIN_ROWS) -> HeadScreen | None:
    """The screen's panel for ``w`` (~1.4x its packed bytes, built once), or None where it does
    not apply: not q8, no kernels, or weights the screen cannot bound (a non-finite scale; a
    -128 weight in the AVX2 build)."""
    kernels = load()
    if kernels.lib is None or not hasattr(kernels.lib, "lowbit_head_screen_argmax") or w.kind != "q8":
        return None
    N, K = w.shape
    size = kernels.lib.head_screen_panel_bytes(N, K)
    raw = torch.empty(size + 32, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % 32
    arow = ctypes.c_float()
    failed = kernels.lib.head_screen_prepare(
        w.qs.contiguous().data_ptr(), w.d.contiguous().data_ptr(), N, K, raw.data_ptr() + offset, ctypes.byref(arow)
    )
    return None if failed else HeadScreen(raw, offset, arow.value, kernels.isa, min_rows)


def screened_head_argmax(
    x: torch.Tensor,
    w: QuantWeight,
    screen: HeadScreen,
    max_int_rows: int = 0,
    min_int8_rows: int = 0,
    threads: int | None = None,
) -> tuple[torch.Tensor | None, int]:
    """head_screen.c at any row count (head_argmax's choice skipped; tests, benchmarks): the
    indices (None for a NaN logit) and how many vocabulary rows it recomputed exactly (-1 where
    it refused the screen and took head.c's whole head)."""
    kernels = load()
    if screen.isa != kernels.isa:
        raise ValueError(f"the screen was prepared by the {screen.isa} build, the kernels are {kernels.isa}")
    x, M, K = _rows(x, w)
    out = torch.empty(M, dtype=torch.int64)
    if M == 0:
        return out, 0
    stats = torch.zeros(1, dtype=torch.int64)
    m_ptr = w.m.data_ptr() if w.m is not None else None
    failed = kernels.lib.lowbit_head_screen_argmax(
        x.data_ptr(),
        M,
        K,
        KIND_CODE[w.kind],
        w.qs.data_ptr(),
        w.d.data_ptr(),
        m_ptr,
        w.qs.shape[0],
        max_int_rows,
        min_int8_rows,
        threads or torch.get_num_threads(),
        screen.pointer,
        screen.arow,
        out.data_ptr(),
        stats.data_ptr(),
    )
    return (None if failed else out), int(stats[0])
