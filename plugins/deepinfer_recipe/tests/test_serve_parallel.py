"""``deepinfer serve --data-parallel-size 2``: one HTTP endpoint over two engine ranks.

The official ``openai`` SDK sends concurrent chat requests to a server whose requests are spread
over two rank processes (each a whole SmolLM2 engine, stepping in lockstep); every greedy answer
must equal the single-engine server's (the shared ``served`` fixture), and both ranks must have
served some of them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from serve_harness import MODEL, start_subprocess

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three.", "What is the capital of France?"]


def ask(client, question: str) -> str:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0
    )
    return reply.choices[0].message.content


def test_data_parallel_server_answers_like_one_engine_and_uses_both_ranks(oai):
    import openai

    proc, url = start_subprocess("--data-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            answers = list(pool.map(lambda q: ask(client, q), QUESTIONS))
        assert answers == [ask(oai, q) for q in QUESTIONS]
        ranks = httpx.get(f"{url}/health", timeout=10).json()["ranks"]
        assert len(ranks) == 2 and all(r.get("busy_steps", 0) > 0 for r in ranks), ranks
    finally:
        proc.terminate()
        proc.wait(60)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
