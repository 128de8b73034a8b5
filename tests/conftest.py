"""Fixtures shared by several test modules."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    for tiny matmuls the intra-op thread hand-off costs more than it saves, and on a shared
    2-core machine spinning intra-op threads made such a module 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
