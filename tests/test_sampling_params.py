"""SamplingParams refuses every bad field with one error naming it and the allowed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deepinfer_core import SamplingParams


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("skip_special_tokens", "no", TypeError),
        ("ignore_eos", 1, TypeError),
        ("include_stop_str_in_output", None, TypeError),
        ("top_k", True, TypeError),
        ("top_k", 2.5, TypeError),
        ("top_k", -2, ValueError),
        ("temperature", "0.5", TypeError),
        ("temperature", float("nan"), ValueError),
        ("temperature", float("inf"), ValueError),
        ("temperature", 1e300, ValueError),
        ("temperature", True, TypeError),
        ("top_p", 0.0, ValueError),
        ("min_p", -0.1, ValueError),
        ("presence_penalty", 3.0, ValueError),
        ("frequency_penalty", float("-inf"), ValueError),
        ("repetition_penalty", 1e30, ValueError),
        ("repetition_penalty", 1e-30, ValueError),
        ("repetition_penalty", 0, ValueError),
        ("max_tokens", -3, ValueError),
        ("max_tokens", 0, ValueError),
        ("max_tokens", 2.0, TypeError),
        ("min_tokens", -1, ValueError),
        ("seed", "7", TypeError),
        ("seed", 2**70, ValueError),
        ("n", 2, ValueError),
        ("stop", 5, TypeError),
        ("stop", [""], ValueError),
        ("stop", ["ok", 3], TypeError),
        ("stop", b"x", TypeError),
        ("stop_token_ids", 5, TypeError),
        ("stop_token_ids", [2**63], ValueError),
        ("stop_token_ids", [-1], ValueError),
        ("stop_token_ids", [True], TypeError),
        ("stop_token_ids", ["3"], TypeError),
    ],
)
def test_bad_field_is_named_at_construction(field, value, exc):
    with pytest.raises(exc, match=rf"sampling parameter {field}=.*must be"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [("temperature", math.nan), ("max_tokens", -3), ("skip_special_tokens", "no"), ("stop", 5), ("top_k", True)],
)
def test_fields_changed_after_construction_are_checked_again(field, value):
    params = SamplingParams()
    setattr(params, field, value)
    with pytest.raises((ValueError, TypeError), match=field):
        params.checked()


def test_checked_copy_is_independent_of_the_original():
    params = SamplingParams(stop=["a"], stop_token_ids=[3])
    copy = params.checked()
    params.stop.append("b")
    params.stop_token_ids.append(4)
    params.max_tokens = 99
    assert copy.stop == ["a"] and copy.stop_token_ids == [3] and copy.max_tokens == 16


def test_numpy_numbers_are_accepted_as_plain_numbers():
    params = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(5), stop_token_ids=[np.int64(3)], seed=np.int32(4)
    )
    assert type(params.top_k) is int and type(params.temperature) is float
    assert params.stop_token_ids == [3] and type(params.stop_token_ids[0]) is int and params.seed == 4


def test_vllm_spellings_still_work():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("x", "y"), stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    assert SamplingParams(max_tokens=None, min_tokens=5).max_tokens is None


def test_temperatures_too_small_to_represent_are_greedy():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
