"""The per-step constructors of the engine's two frozen per-request records build the same
objects as the dataclasses' own ``__init__`` (they fill the instance dict directly: the generated
``__init__`` goes through ``object.__setattr__`` per field, ~4x slower, 512 times a 256-request
step). A field added to either dataclass without the constructor knowing fails here."""

from __future__ import annotations

import dataclasses

import numpy as np

from deepinfer_core.engine.sampler import SamplingRow, sampling_row
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.scheduler import ScheduledRequest, scheduled_request


def _same(fast, slow) -> None:
    assert type(fast) is type(slow)
    assert fast == slow and repr(fast) == repr(slow)
    try:
        want = hash(slow)
    except TypeError:  # a SamplingRow holds lists: unhashable either way
        want = None
    if want is not None:
        assert hash(fast) == want
    names = [f.name for f in dataclasses.fields(slow)]
    assert list(vars(fast)) == list(vars(slow)) == names  # every field, in order, nothing else
    assert all(getattr(fast, n) is getattr(slow, n) for n in names)
    try:
        fast.seed = 1
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("the fast constructor's object is not frozen")


def test_scheduled_request_equals_the_dataclass():
    view = np.arange(4, dtype=np.uint32)
    args = ("req-7", (5, 6, 7, 8), 12, (3, 9), True, 1234, 16)
    _same(scheduled_request(*args, view), ScheduledRequest(*args, token_array=view))
    _same(scheduled_request(*args[:6]), ScheduledRequest(*args[:6]))  # the defaults


def test_sampling_row_equals_the_dataclass():
    params, prompt, out = SamplingParams(temperature=0.7, top_p=0.9, seed=3), [1, 2, 3], [4]
    _same(sampling_row(params, 99, 4, prompt, out, (0, 2)), SamplingRow(params, 99, 4, prompt, out, (0, 2)))
    _same(sampling_row(params, 99, 4, prompt, out), SamplingRow(params, 99, 4, prompt, out))
