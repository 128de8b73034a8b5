"""Zero-filled CPU tensors whose pages the OS supplies on first write.

``torch.zeros`` on CPU writes every byte when it allocates. The KV cache the engine sizes from
free memory (1 GiB for SmolLM2 on a 2-core machine with 24 GiB) then cost 0.9-2 s of every
start-up and counted whole in the resident set from the first moment, although a short chat
writes a few of its blocks. A private anonymous mapping reads as zeros and commits a page only
when it is written, so the cache costs nothing until used. The tensor holds the mapping and it
is unmapped with the tensor's storage.
"""

from __future__ import annotations

import math
import mmap

import torch

_SMALL = 1 << 20  # below this a plain allocation is as cheap and keeps small tensors off mmap


def zeros(
    shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, lazily committed on CPU."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _SMALL:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes)  # MAP_PRIVATE | MAP_ANONYMOUS: zero pages, page-aligned
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
