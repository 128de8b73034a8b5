"""A guard that fails on every host-device synchronisation, for tests of code that must not sync.

:class:`NoHostSync` is a ``TorchDispatchMode`` that raises ``AssertionError`` on each op that needs
a device value on the host (what CUDA-graph capture refuses and what stalls an overlapped step):
``.item()``, ``nonzero``, ``masked_select``, boolean-mask indexing, ``.tolist()`` / ``.numpy()``
(patched, since on a CPU tensor they read memory without an op). It works on the CPU, so a test
proves "no sync" without a GPU. :func:`host_reads_allowed` lifts it for a block the test does not
check (e.g. a reference kernel's expert loop).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["HOST_SYNC_OPS", "NoHostSync", "host_reads_allowed"]

HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "item", "_assert_async", "is_nonzero"})
_HOST_READS = (torch.Tensor.tolist, torch.Tensor.numpy)


class NoHostSync(TorchDispatchMode):
    """Fails on every op that needs a device value on the host. ``what`` names the guarded code in
    the error."""

    def __init__(self, what: str = "the guarded code") -> None:
        super().__init__()
        self.what = what

    def __enter__(self):
        def refuse(name):
            def method(*args, **kwargs):
                raise AssertionError(f"host synchronisation in {self.what}: Tensor.{name}()")

            return method

        torch.Tensor.tolist, torch.Tensor.numpy = refuse("tolist"), refuse("numpy")
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = _HOST_READS
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_SYNC_OPS or (name in ("index", "index_put_", "index_put") and any(
                t is not None and getattr(t, "dtype", None) == torch.bool
                for t in (args[1] if len(args) > 1 else ()))):  # fmt: skip
            raise AssertionError(f"host synchronisation in {self.what}: aten.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads_allowed():
    """Inside :class:`NoHostSync`: a block where host reads are allowed again."""
    guarded = torch.Tensor.tolist, torch.Tensor.numpy
    torch.Tensor.tolist, torch.Tensor.numpy = _HOST_READS
    try:
        with _disable_current_modes():
            yield
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = guarded
