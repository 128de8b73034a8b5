"""DeepSeek-V4 state KV after a prefix hit (issue 29, deliverables 3 and 4): exact vs compact
(bounded) replay, and the short-lived window cache.

Independent references: transformers' generate / logits. For compact replay the reference is a
model with only sliding-window layers, whose attention depends on relative positions only (rope on
queries and K=V keys, undone at the query): there, re-running the last ``keep`` tokens with
attention bounded to them is exactly transformers run on those ``keep`` tokens + the suffix from
position 0. A replay that read one token more, or anything the slot held before, would differ.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.fail("transformers >= 5.24 (DeepseekV4) is required for the DeepSeek-V4 tests")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.engine.config import EngineConfig  # noqa: E402
from deepinfer_core.engine.window_cache import WindowCache  # noqa: E402
from deepinfer_core.testing.v4_tiny import TINY_V4_KWARGS, save_tiny_v4, tiny_v4_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
VOCAB = TINY_V4_KWARGS["vocab_size"]
# tiny V4: 5 layers, window 16 -> exact replay 4 * 15 + max(15, HCA tail 16) = 76 tokens
EXACT = 4 * 15 + 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4-swa")
    return str(path), save_tiny_v4(path, seed=4321, randomise_seed=6)


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4-swa-sliding")
    config = tiny_v4_config(layer_types=["sliding_attention"] * 5)
    return str(path), save_tiny_v4(path, seed=99, randomise_seed=7, config=config)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(new: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, **kw)


def hf_generate(hf, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def engine(path: str, **options) -> LLM:
    return LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, **options)


def first_logits(llm: LLM, prompt: list[int], new: int):
    """(the request's output, the logits [V] of its first sampled position)."""
    seen = []
    out = llm.generate([prompt], greedy(new, logits_processors=[lambda ids, x: seen.append(x.clone()) or x]))[0]
    return out, seen[0]


def test_exact_replay_rebuilds_the_state_as_a_full_prefill(tiny):
    path, hf = tiny
    base, suffix = tokens(404, 1), tokens(20, 2)  # as long as the query (see test_deepseek_v4_configs' ties)
    llm = engine(path, window_cache_seconds=0)
    llm.generate([base], greedy(1))
    out = llm.generate([base[:384] + suffix], greedy(10))[0]
    assert out.num_cached_tokens == 384
    assert out.metrics["swa_num_replayed_tokens"] == EXACT and out.metrics["swa_window_cache_hits"] == 0
    assert llm.engine.stats()["swa_replayed_tokens"] == EXACT
    assert out.outputs[0].token_ids == hf_generate(hf, base[:384] + suffix, 10)


@pytest.mark.parametrize("keep", [15, 23])
def test_compact_replays_keep_tokens_with_attention_bounded_to_them(sliding, keep):
    path, hf = sliding
    base, suffix = tokens(300, 3), tokens(6, 4)
    llm = engine(path, window_cache_seconds=0, swa_replay="compact", swa_replay_keep=keep)
    llm.generate([base], greedy(1))
    # another request's window first: a replay that read the slot's old rows would see them
    llm.generate([tokens(200, 5)], greedy(3))
    out, logits = first_logits(llm, base[:256] + suffix, 8)
    assert out.num_cached_tokens == 256 and out.metrics["swa_num_replayed_tokens"] == keep
    window = base[256 - keep : 256] + suffix  # what the bounded replay + suffix can see
    with torch.no_grad():
        ref = hf(torch.tensor([window])).logits[0, -1].float()
    assert (logits - ref).abs().max().item() < 1e-4
    assert out.outputs[0].token_ids == hf_generate(hf, window, 8)
    # the same model with exact replay sees the whole context (and is not the truncated one)
    exact, exact_logits = first_logits(engine(path, window_cache_seconds=0), base[:256] + suffix, 8)
    with torch.no_grad():
        full = hf(torch.tensor([base[:256] + suffix])).logits[0, -1].float()
    assert (exact_logits - full).abs().max().item() < 1e-4
    assert (full - ref).abs().max().item() > 1e-3


def test_compact_keep_past_exact_is_exact_and_too_small_a_keep_is_refused(tiny):
    path, hf = tiny
    base, suffix = tokens(261, 6), tokens(5, 7)
    llm = engine(path, window_cache_seconds=0, swa_replay="compact")  # keep 140 > 76: exact already
    llm.generate([base], greedy(1))
    out = llm.generate([base[:256] + suffix], greedy(8))[0]
    assert out.metrics["swa_num_replayed_tokens"] == EXACT
    assert out.outputs[0].token_ids == hf_generate(hf, base[:256] + suffix, 8)
    with pytest.raises(ValueError, match="swa_replay_keep=15 is too small.*at least 16"):
        engine(path, swa_replay="compact", swa_replay_keep=15)  # the HCA tail holds 16 positions


@pytest.mark.parametrize("mode", ["exact", "compact"])
def test_window_cache_hit_needs_no_replay_and_gives_the_tokens_of_no_cache(tiny, mode):
    # a conversation's next turn: the previous prompt and output, then new tokens
    path, hf = tiny
    llm = engine(path, swa_replay=mode, swa_replay_keep=16)
    first = llm.generate([tokens(380, 8)], greedy(10))[0]  # decode crosses 384: state saved there
    turn = tokens(380, 8) + first.outputs[0].token_ids + tokens(7, 9)
    out = llm.generate([turn], greedy(10))[0]
    assert out.num_cached_tokens == 384
    assert out.metrics["swa_window_cache_hits"] == 1 and out.metrics["swa_num_replayed_tokens"] == 0
    stats = llm.engine.stats()
    assert stats["window_cache_hits"] == stats["window_cache_queries"] == 1 and stats["swa_replayed_tokens"] == 0
    assert out.outputs[0].token_ids == hf_generate(hf, turn, 10)  # exact state even in compact mode


def test_window_cache_entries_expire_on_the_clock(tiny):
    path, hf = tiny
    now = [1000.0]
    llm = engine(path, window_cache_seconds=180)
    llm.engine.rebuild.window_cache.clock = lambda: now[0]
    prompt = tokens(380, 10)
    first = llm.generate([prompt], greedy(5))[0]  # state saved at 384, kept from t = 1000
    turn = prompt + first.outputs[0].token_ids + tokens(3, 11)
    now[0] += 179.0
    assert llm.generate([turn], greedy(4))[0].metrics["swa_window_cache_hits"] == 1
    now[0] += 181.0  # the entry was stored again when that request left (t = 1179): now past 180 s
    late = llm.generate([turn], greedy(4))[0]
    assert late.metrics["swa_window_cache_hits"] == 0 and late.metrics["swa_num_replayed_tokens"] == EXACT
    assert llm.engine.stats()["window_cache_expired"] == 1
    assert late.outputs[0].token_ids == hf_generate(hf, turn, 4)


def _state(slots: int = 3):
    return [torch.zeros(slots, 4, 8), torch.zeros(slots, 2, 3)]  # a ring and a tail per "layer"


def test_window_cache_byte_bound_evicts_the_oldest():
    state = _state()
    entry_bytes = (4 * 8 + 2 * 3) * 4
    cache = WindowCache(state, ttl_s=60.0, max_bytes=2 * entry_bytes, clock=lambda: 0.0)
    for i, name in enumerate("abc"):
        state[0][0].fill_(i + 1)
        state[1][0].fill_(-(i + 1))
        cache.capture(name, 0, name.encode())
        cache.release(name, 0)
    assert list(cache.entries) == [b"b", b"c"] and cache.nbytes == 2 * entry_bytes and cache.evicted == 1
    state[0][0].fill_(4)
    cache.capture("d", 0, b"d")  # a running request's pending copy counts too: the oldest entry goes
    assert list(cache.entries) == [b"c"] and cache.evicted == 2
    state[0][1].fill_(5)
    state[1][1].fill_(-5)
    cache.capture("e", 1, b"e")
    cache.capture("f", 2, b"f")  # pending copies fill the bound: not captured (its hits will replay)
    assert list(cache.entries) == [] and "f" not in cache.pending and cache.not_captured == 1
    cache.release("d", 0)
    cache.release("e", 1)
    assert list(cache.entries) == [b"d", b"e"] and cache.nbytes == 2 * entry_bytes and cache.pending_bytes == 0
    assert not cache.restore(b"a", lambda: 1)
    assert cache.restore(b"e", lambda: 2)
    assert bool((state[0][2] == 5).all()) and bool((state[1][2] == -5).all())  # slot 1 at e's capture
    assert cache.stats()["window_cache_hits"] == 1 and cache.stats()["window_cache_queries"] == 2
    small = WindowCache(state, ttl_s=60.0, max_bytes=entry_bytes - 1)
    small.capture("x", 0, b"x")
    small.release("x", 0)
    assert not small.entries  # larger than the bound: never kept


def test_window_cache_keeps_a_request_s_last_boundary_only_once_it_leaves():
    state = _state()
    now = [0.0]
    cache = WindowCache(state, ttl_s=10.0, max_bytes=1 << 20, clock=lambda: now[0])
    cache.capture("r", 1, b"k1")
    cache.capture("r", 1, b"k2")  # the next boundary replaces the first
    assert not cache.entries and not cache.restore(b"k2", lambda: 0)
    cache.release("r", 1)
    assert list(cache.entries) == [b"k2"]
    now[0] = 10.0
    assert not cache.restore(b"k2", lambda: 0) and cache.expired == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(swa_replay="fast"), "unknown swa_replay 'fast'; use one of exact, compact"),
        (dict(swa_replay_keep=0), "swa_replay_keep must be an integer >= 1, got 0"),
        (dict(swa_replay_keep=1.5), "swa_replay_keep must be an integer >= 1, got 1.5"),
        (dict(swa_replay_keep=True), "swa_replay_keep must be an integer >= 1, got True"),
        (dict(window_cache_seconds=-1), "window_cache_seconds must be >= 0"),
        (dict(window_cache_gib=0), "window_cache_gib must be > 0"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError) as err:
        EngineConfig("m", **options)
    assert message in str(err.value)


def test_options_are_on_every_command_and_the_counters_on_metrics():
    from deepinfer_core.entrypoints.main import build_parser
    from deepinfer_core.serve.metrics import ServerMetrics

    parser = build_parser()
    for command in (["generate", "hi"], ["serve"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--swa-replay", "fast"])
        args = parser.parse_args([*command, "--swa-replay", "compact", "--swa-replay-keep", "200"])
        assert (args.swa_replay, args.swa_replay_keep) == ("compact", 200)
    pytest.importorskip("prometheus_client")  # the serve extra; the core env has the engine alone
    metrics = ServerMetrics("m")
    metrics.on_step({"swa_replayed_tokens": 76, "window_cache_queries": 3, "window_cache_hits": 2})
    text = metrics.render()[0].decode()
    assert 'deepinfer:swa_replayed_tokens_total{model_name="m"} 76.0' in text
    assert 'deepinfer:window_cache_hits_total{model_name="m"} 2.0' in text
