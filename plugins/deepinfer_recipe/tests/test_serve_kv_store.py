"""``deepinfer serve --kv-store``: a prompt served by one server process is served from the
store by the next one, and the official ``openai`` SDK reads the cached tokens in ``usage``."""

from __future__ import annotations

import signal

import openai
from serve_harness import MODEL, start_subprocess

BLOCK = 32  # the harness's block size
PROMPT = " ".join(f"Item {i}: a {['red', 'green', 'blue'][i % 3]} box holds {i * 3} marbles." for i in range(60))


def complete(base_url: str):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 0


def test_usage_reports_tokens_cached_by_the_previous_server_process(tmp_path):
    url = f"local://{tmp_path / 'kv'}"
    first_proc, base = start_subprocess("--kv-store", url)
    try:
        first = complete(base)
    finally:
        stop(first_proc)
    second_proc, base = start_subprocess("--kv-store", url)
    try:
        second = complete(base)
    finally:
        stop(second_proc)
    prompt_tokens = first.usage.prompt_tokens
    assert 600 < prompt_tokens < 1000 and second.usage.prompt_tokens == prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert (
        second.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // BLOCK * BLOCK >= 0.9 * prompt_tokens
    )
    assert second.choices[0].text == first.choices[0].text and first.usage.completion_tokens == 6
