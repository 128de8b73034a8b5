"""Build a model without filling its parameters with random numbers first.

Every ``nn.Linear`` and ``nn.Embedding`` draws random initial values in its constructor, which
the checkpoint then overwrites: for SmolLM2 that is 135M random draws, and the first ``normal_``
call also imports ``torch._dynamo`` (seconds on a small CPU) because torch wraps the init
functions in a dynamo guard. The loaders raise on any missing parameter (optional groups such as
DeepSeek-V4's MTP block are refused at use when absent), so no parameter is ever used with the
values it was built with, and skipping the draws changes no result.

:func:`materialize` allocates a model built on the meta device: ``Module.to_empty`` calls
``empty_like`` on meta tensors, which runs through ``torch._refs``; its first use imports sympy
and torch's symbolic-shape machinery (1.4-2.6 s measured on a 2-core CPU, on every start).
``torch.empty`` of the same shape and dtype gives the same uninitialised parameters without it.

The ``torch.nn.init`` functions are replaced for the duration of the build, as Hugging Face
transformers does for the same reason; a lock keeps two engines built in threads at once from
restoring each other's patch early.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

_NAMES = (
    "normal_",
    "uniform_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "trunc_normal_",
    "orthogonal_",
    "zeros_",
    "ones_",
    "constant_",
)
_LOCK = threading.Lock()


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextmanager
def skip_random_init() -> Iterator[None]:
    """Inside: module constructors leave parameters as allocated (uninitialised)."""
    with _LOCK:
        saved = {name: getattr(torch.nn.init, name) for name in _NAMES}
        try:
            for name in _NAMES:
                setattr(torch.nn.init, name, _keep)
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch.nn.init, name, fn)


def allocate(model: torch.nn.Module, ctx) -> torch.nn.Module:
    """Allocate a model built on the meta device on ``ctx.device`` (a
    :class:`~deepinfer_core.causal_lm.ModelContext`), after ``ctx.swap_modules`` has replaced
    what the loader keeps packed: a model's dtype cast belongs before this call, so no tensor
    is ever allocated in a wider type or a dense form only to be dropped."""
    if ctx.swap_modules is not None:
        ctx.swap_modules(model)
    return materialize(model, ctx.device)


def materialize(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``module.to_empty(device=device)`` without the ``torch._refs`` import (see the module
    docstring); strides are kept as ``empty_like`` keeps them."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    return module._apply(empty)
