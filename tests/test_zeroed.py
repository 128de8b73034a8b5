"""deepinfer_core.engine.zeroed: CPU zeros that equal ``torch.zeros`` and are writable like it,
without committing their pages until written (the resident set, read from /proc, does not grow
by the allocation)."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_core.engine.zeroed import zeros


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("shape", [(3, 5), (64, 2, 128, 3, 64)])
def test_equals_torch_zeros_and_takes_writes(shape, dtype):
    got = zeros(shape, dtype, "cpu")
    want = torch.zeros(shape, dtype=dtype)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous() and torch.equal(got, want)
    got[1] = 3
    want[1] = 3
    assert torch.equal(got, want) and torch.equal(got.clone(), want)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_pages_are_committed_only_when_written():
    size = 256 << 20
    before = resident_bytes()
    cache = zeros((256, 1 << 18), torch.float32, "cpu")  # 256 MiB
    assert resident_bytes() - before < size // 8
    cache[:16] = 1.0  # 16 MiB written
    assert resident_bytes() - before < size // 4
    assert cache.sum().item() == 16 * (1 << 18)


def test_other_devices_pass_through():
    assert zeros((2, 3), torch.float32, "meta").device.type == "meta"
