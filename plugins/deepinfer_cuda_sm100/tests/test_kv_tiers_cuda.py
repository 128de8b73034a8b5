"""On a CUDA device: the persistent KV store's device path (issue 9), which CPU runs cannot prove.

A hit from the store on a GPU goes store -> pinned host buffers (loader threads) -> device
blocks, copied on a side stream that the compute stream waits for by an event
(engine/kv_host.py). Each test compares an engine that reads the store with an engine that has
no store (it computed the whole prompt itself): identical greedy tokens mean the bytes reached
the right device blocks before the forward read them. Builtin backends and this plugin's
defaults, a tiny Llama (GQA blocks) and a tiny DeepSeek-V3 (MLA latent blocks), random weights.

Skipped without CUDA (CI has none). ``DEEPINFER_KV_TIERS_TEST_DEVICE=cpu`` runs the same tests
on the host, to check the tests themselves where no GPU is at hand (the CPU path of the tiers
has its own tests in tests/test_kv_tiers.py).
"""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.testing.v3_checkpoint import SMALL_V3_CONFIG, tiny_deepseek_v3

DEVICE = os.environ.get("DEEPINFER_KV_TIERS_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
transformers = pytest.importorskip("transformers")

PROMPT = 600  # 4 full blocks of 128 are servable from the store: 512 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _llama(path) -> int:
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return cfg.vocab_size


def _deepseek_v3(path) -> int:
    return tiny_deepseek_v3(path, seed=99, **SMALL_V3_CONFIG).config.vocab_size


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    vocab = {"llama": _llama, "deepseek_v3": _deepseek_v3}[request.param](path)
    prompt = torch.randint(2, vocab, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    return str(path), prompt


@pytest.fixture(scope="module", params=["builtin", "plugin"])
def setup(request, model):
    """The model, its prompt, the engine arguments and the no-store reference tokens."""
    path, prompt = model
    backends = {"attention_backend": "builtin", "moe_backend": "builtin"} if request.param == "builtin" else {}
    kw = dict(device=DEVICE, dtype="float32", kv_cache_blocks=16, max_num_seqs=4, kv_host_pool_gib=1 / 16, **backends)
    ref = LLM(path, **kw).generate([prompt], GREEDY)[0].outputs[0].token_ids
    return path, prompt, kw, ref


def _written(setup, root) -> str:
    """A store holding the prompt's 4 blocks, written back by an engine on the device."""
    path, prompt, kw, ref = setup
    url = f"local://{root}"
    a = LLM(path, kv_store=url, **kw)
    out = a.generate([prompt], GREEDY)[0]
    a.engine.tiers.flush()
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == ref
    assert a.engine.stats()["kv_tiers"]["blocks_written"] == 4
    return url


def test_store_hit_on_the_device_equals_no_store(setup, tmp_path):
    path, prompt, kw, ref = setup
    url = _written(setup, tmp_path / "store")
    b = LLM(path, kv_store=url, **kw)
    names = sorted({getattr(m.backend, "name", "") for m in b.engine.model.modules() if hasattr(m, "backend")})
    out = b.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 512 and out.outputs[0].token_ids == ref, f"backends {names}"
    tiers = b.engine.tiers
    stats = tiers.stats()
    moved = "host_to_device_blocks" if DEVICE == "cuda" else "store_to_cache_blocks"  # the CPU reads into the cache
    assert stats["store_blocks_loaded"] == 4 and stats[moved] == 4
    if DEVICE == "cuda":
        assert tiers.host.pin and tiers.h2d.stream != torch.cuda.current_stream()
        assert all(buf.is_pinned() for buf in tiers.host._blocks.values())
        torch.cuda.synchronize()
    tiers.h2d.reap()
    assert tiers.h2d.held() == 0  # sources released once the device passed the event
    # the device prefix cache now serves the same blocks: a branch of the prompt
    branch = prompt[:300] + prompt[:50]
    want = LLM(path, **kw).generate([branch], GREEDY)[0].outputs[0].token_ids
    got = b.generate([branch], GREEDY)[0]
    assert got.num_cached_tokens == 256 and got.outputs[0].token_ids == want


def test_abort_while_loading_then_the_same_prompt_on_the_device(setup, tmp_path):
    path, prompt, kw, ref = setup
    url = _written(setup, tmp_path / "store")
    b = LLM(path, kv_store=url, **kw)
    store = b.engine.tiers.store
    gate = threading.Event()
    real_read = store.read_into
    store.read_into = lambda lease, buffers: gate.wait(120) and real_read(lease, buffers)
    rid = b.engine.add_request(prompt, GREEDY)
    other = b.engine.add_request(prompt[:40][::-1], SamplingParams(temperature=0, max_tokens=4))
    done: dict = {}
    while other not in done:
        done.update({o.request_id: o for o in b.engine.step() if o.finished})
    assert [r.request_id for r in b.engine.scheduler.loading] == [rid]
    aborted = b.engine.abort_request(rid)
    assert aborted is not None and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    gate.set()
    b.engine.tiers._loader.submit(lambda: None).result(timeout=120)  # the aborted load has ended
    assert not b.engine.has_unfinished_requests()
    out = b.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 512 and out.outputs[0].token_ids == ref
    assert b.engine.kv.pool.num_free == b.engine.num_blocks  # nothing leaked by the abort


def test_write_failure_on_the_device_is_counted_and_not_fatal(setup, tmp_path):
    path, prompt, kw, ref = setup
    a = LLM(path, kv_store=f"local://{tmp_path / 'store'}", **kw)

    def broken(path, parts):
        raise OSError(errno.EIO, "Input/output error", path)

    a.engine.tiers.store.io.write_file = broken
    out = a.generate([prompt], GREEDY)[0]
    a.engine.tiers.flush()
    assert out.outputs[0].token_ids == ref
    stats = a.engine.stats()["kv_tiers"]
    assert stats["write_failures"] >= 1 and stats["store"]["blocks"] == 0
    again = a.generate([prompt], GREEDY)[0]  # still serving: from its device prefix cache
    assert again.num_cached_tokens == 512 and again.outputs[0].token_ids == ref
