"""Programmatic dependent launch (PDL, SM90+) for the decode step's small kernels.

Why: a one-request decode step is ~150 launches, most of them a few microseconds long and bound
by latency (H200, V3-mini bf16: 0.705 ms of kernel time in a 0.752 ms graph replay, the 42
GEMVs at 1.85 TB/s against 4.2 TB/s for a copy). With PDL a kernel may start while the one
before it in the stream is still running: its programs are scheduled, set up, and (GEMVs) issue
their weight loads, then wait at ``gdc_wait`` until the previous kernel has finished and its
writes are visible. Each kernel calls ``gdc_launch_dependents`` on entry, so the next one is
launched as soon as every program of this one is resident.

The rules every kernel launched with :func:`launch_kw` keeps:
- before :func:`gdc_enter`'s wait it reads only memory no kernel of the stream writes (module
  weights) and writes nothing;
- it always reaches the wait (no early return before it), so its completion implies the
  completion of everything before it in the stream; a kernel launched without PDL (torch,
  cuBLAS) waits for its predecessor as usual.
Results do not change (the same arithmetic, only when it may start). CUDA graphs keep the
dependency as a programmatic edge when captured (CUDA 12.3+).

Off (plain launches, no wait compiled in) under Triton's interpreter, on GPUs below SM90, where
this Triton cannot launch with PDL (probed once), and with ``DEEPINFER_PDL=0``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from deepinfer_core import envs


@triton.jit
def gdc_enter(ON: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (its writes visible)."""
    if ON:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _probe_kernel(x_ptr, ON: tl.constexpr):
    gdc_enter(ON)
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


@functools.cache
def _supported(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.version.hip is not None:
        return False
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    try:  # this Triton compiles the gdc instructions and launches with PDL (no sync: may run in a capture)
        _probe_kernel[(1,)](torch.zeros(1, device=f"cuda:{index}"), ON=True, launch_pdl=True)
        return True
    except Exception:  # noqa: BLE001 - any failure: plain launches
        return False


def enabled(t: torch.Tensor) -> bool:
    """PDL for kernels working on ``t``'s device (see the module's conditions)."""
    if not envs.get("DEEPINFER_PDL") or not t.is_cuda:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


def launch_kw(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel taking a ``PDL`` constexpr that it passes to
    :func:`gdc_enter`: ``PDL=True, launch_pdl=True`` where :func:`enabled`, else ``PDL=False``."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}
