"""Without a CUDA device the Triton kernels run in Triton's interpreter (on CPU tensors), so
CI checks every kernel's arithmetic; the variable must be set before Triton compiles anything."""

from __future__ import annotations

import os


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
