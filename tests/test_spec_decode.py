"""Speculative decoding in the engine: the output with drafts is the output without them.

The reference is the same model decoding without speculation (a separate engine, or for
SmolLM2 the same engine with drafting switched off), token for token, for greedy and for seeded
sampled requests in one batch. An oracle drafter that knows that output must have every draft
accepted, an always-wrong one none, and neither may change a token. Preemption, prefix-cache and
KV-store hits and DeepSeek-V4's state KV (rings with speculative rows) are exercised on tiny
random models; n-gram with a JSON grammar on SmolLM2's real weights.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_host import PluginHost

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class TableDrafter:
    """Drafts from the known spec-off sequences (``wrong``: every draft off by one)."""

    name = "table"
    needs_token_ids = True

    def __init__(self, sequences: list[list[int]], vocab: int, wrong: bool = False) -> None:
        self.sequences, self.vocab, self.wrong = sequences, vocab, wrong
        self.released: list[str] = []

    def propose(self, batch, num_tokens):
        R = len(batch.request_ids)
        ids = torch.zeros(R, num_tokens, dtype=torch.long)
        conf = torch.zeros(R, num_tokens)
        for r, hist in enumerate(batch.token_ids):
            assert hist[-1] == int(batch.last_token_ids[r]) and len(hist) - 1 == int(batch.positions[r])
            seq = next(s for s in self.sequences if s[: len(hist)] == hist)
            nxt = seq[len(hist) : len(hist) + num_tokens]
            if self.wrong:
                nxt = [(t + 1) % self.vocab for t in nxt]
            ids[r, : len(nxt)] = torch.tensor(nxt, dtype=torch.long)
            conf[r, : len(nxt)] = 0.9
        return ids, conf

    def release(self, request_id):
        self.released.append(request_id)


def host_with(drafter) -> PluginHost:
    class Plugin:
        @hookimpl
        def deepinfer_register_spec_policies(self, register_drafter):
            register_drafter("table", lambda config, ctx: drafter)

    return PluginHost(extra_plugins={"spec-test": Plugin()})


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], [o.metrics for o in outs]


def mixed_params(n: int, max_tokens: int, stop_at=None) -> list[SamplingParams]:
    """Greedy and seeded sampled requests alternating."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        else:
            out.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True))
    return out


def _prompts(n: int, length: int, vocab: int, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    head = torch.randint(2, vocab, (shared,), generator=g).tolist()
    return [head + torch.randint(2, vocab, (length - shared,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    prompts = _prompts(4, 40, 96, shared=32)
    params = mixed_params(4, 30)
    llm = LLM(tiny_llama, device="cpu", dtype="float32", block_size=16, kv_cache_blocks=64)
    tokens, metrics = run(llm, prompts, params)
    assert metrics == [None] * 4  # speculation off: no speculative metrics
    return prompts, params, tokens


@pytest.mark.parametrize("wrong", [False, True], ids=["oracle", "always-wrong"])
def test_oracle_accepts_everything_and_wrong_nothing_same_output(tiny_llama, llama_reference, wrong):
    prompts, params, expected = llama_reference
    drafter = TableDrafter([p + e for p, e in zip(prompts, expected)], 96, wrong=wrong)
    llm = LLM(
        tiny_llama, host=host_with(drafter), device="cpu", dtype="float32", block_size=16, kv_cache_blocks=64,
        speculative_config={"method": "table", "num_speculative_tokens": 4},
    )  # fmt: skip
    tokens, metrics = run(llm, prompts, params)
    assert tokens == expected
    for m in metrics:
        assert m["spec_num_draft_tokens"] > 0
        assert m["spec_num_accepted_tokens"] == (0 if wrong else m["spec_num_draft_tokens"])
    stats = llm.engine.stats()["spec_decode"]
    assert stats["num_accepted_tokens"] == sum(m["spec_num_accepted_tokens"] for m in metrics)
    if not wrong:  # 30 tokens in ~30 / 5 steps: several tokens per step
        assert all(m["spec_num_drafts"] <= 8 for m in metrics)
        assert stats["accepted_per_position"][3] > 0
    assert sorted(drafter.released) == sorted(str(i) for i in range(4))  # every request released


@pytest.mark.parametrize("as_rows", [True, False], ids=["decode-rows", "causal-runs"])
def test_verify_steps_as_decode_rows_or_causal_runs_same_output(tiny_llama, llama_reference, as_rows):
    """A Llama verify step is laid out as decode rows, one per token (each its request's block
    table, seq_len = position + 1: the decode kernels and their captured graphs take it); the
    causal layout (a run of rows per request) gives the same tokens."""
    prompts, params, expected = llama_reference
    drafter = TableDrafter([p + e for p, e in zip(prompts, expected)], 96)
    llm = LLM(
        tiny_llama, host=host_with(drafter), device="cpu", dtype="float32", block_size=16, kv_cache_blocks=64,
        speculative_config={"method": "table", "num_speculative_tokens": 3},
    )  # fmt: skip
    runner, model = llm.engine.runner, llm.engine.model
    assert runner.verify_as_decode_rows  # the model declares it (LlamaForCausalLM.verify_as_decode_rows)
    runner.verify_as_decode_rows = as_rows
    shapes, forward = [], model.forward

    def recording(input_ids, positions, kv_caches, meta):
        shapes.append((int(input_ids.shape[0]), meta.num_requests, meta.max_query_len))
        return forward(input_ids, positions, kv_caches, meta)

    model.forward = recording
    tokens, metrics = run(llm, prompts, params)
    assert tokens == expected
    assert all(m["spec_num_accepted_tokens"] == m["spec_num_draft_tokens"] > 0 for m in metrics)
    as_decode = [n for n, r, q in shapes if q == 1 and n == r and n > len(prompts)]  # more rows than requests
    causal = [n for n, r, q in shapes if q == 4]  # [last token, 3 drafts] per request
    assert (as_decode and not causal) if as_rows else (causal and not as_decode)


def test_stops_inside_an_accepted_run_truncate_like_decoding(tiny_llama, llama_reference):
    prompts, _, expected = llama_reference
    params = [
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[expected[0][7]], ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
    ]
    drafter = TableDrafter([p + e for p, e in zip(prompts, expected)], 96)
    llm = LLM(
        tiny_llama, host=host_with(drafter), device="cpu", dtype="float32", block_size=16, kv_cache_blocks=64,
        speculative_config={"method": "table", "num_speculative_tokens": 5},
    )  # fmt: skip
    tokens, _ = run(llm, [prompts[0], prompts[2]], params)  # the greedy ones
    first_stop = expected[0].index(expected[0][7])
    assert tokens[0] == expected[0][: first_stop + 1]
    assert tokens[1] == expected[2][:11]


def test_ngram_with_preemption_and_prefix_hits(tiny_llama, llama_reference):
    prompts, params, expected = llama_reference
    # 7 blocks of 16 tokens for 4 requests of 70 tokens: requests are preempted and recomputed
    llm = LLM(
        tiny_llama, device="cpu", dtype="float32", block_size=16, kv_cache_blocks=7,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
    )  # fmt: skip
    first, _ = run(llm, prompts, params)
    again, metrics = run(llm, prompts, params)  # the prompts' shared 32 tokens are cached now
    stats = llm.engine.stats()
    assert first == expected and again == expected
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode"]["num_draft_tokens"] > 0


def test_store_hits_with_speculation(tiny_llama, llama_reference, tmp_path):
    prompts, params, expected = llama_reference
    store = f"local://{tmp_path / 'store'}"
    writer = LLM(tiny_llama, device="cpu", dtype="float32", block_size=16, kv_cache_blocks=64, kv_store=store)
    assert run(writer, prompts, params)[0] == expected
    writer.engine.tiers.flush() if hasattr(writer.engine.tiers, "flush") else None
    del writer
    drafter = TableDrafter([p + e for p, e in zip(prompts, expected)], 96)
    reader = LLM(
        tiny_llama, host=host_with(drafter), device="cpu", dtype="float32", block_size=16, kv_cache_blocks=64,
        kv_store=store, speculative_config={"method": "table", "num_speculative_tokens": 4},
    )  # fmt: skip
    tokens, _ = run(reader, prompts, params)
    assert tokens == expected
    assert reader.engine.stats()["kv_tiers"]["store_blocks_loaded"] > 0


# -- DeepSeek-V4 (state KV) and V3 -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    from deepinfer_core.testing.v4_checkpoint import write_tiny_v4_checkpoint

    path = tmp_path_factory.mktemp("v4spec")
    config = write_tiny_v4_checkpoint(path, weights="bf16", seed=3)
    assert config["num_nextn_predict_layers"] >= 1
    return str(path)


def test_v4_mtp_and_ngram_match_decoding(tiny_v4):
    """Past the 16-token window and several compressor windows (ratios 4 and 128), with
    drafts rejected and accepted: the rings' speculative rows keep the state exact."""
    prompts = [[5 + (i * 7) % 200 for i in range(140)], [9, 8, 7, 6] * 30]
    params = mixed_params(2, 24)
    base = LLM(tiny_v4, device="cpu", dtype="float32", kv_cache_blocks=8)
    expected, _ = run(base, prompts, params)
    for spec in ({"method": "mtp", "num_speculative_tokens": 3}, {"method": "table", "num_speculative_tokens": 3}):
        drafter = TableDrafter([p + e for p, e in zip(prompts, expected)], 320, wrong=False)
        llm = LLM(tiny_v4, host=host_with(drafter), device="cpu", dtype="float32", kv_cache_blocks=8,
                  speculative_config=spec)  # fmt: skip
        tokens, metrics = run(llm, prompts, params)
        assert tokens == expected, spec["method"]
        assert all(m["spec_num_draft_tokens"] > 0 for m in metrics)
        if spec["method"] == "table":
            assert all(m["spec_num_accepted_tokens"] == m["spec_num_draft_tokens"] for m in metrics)


def test_v4_preemption_with_drafts(tiny_v4):
    """Preempted requests restart (state slot released, rebuilt by replay) and still match."""
    prompts = [[3 + (i * 11 + j) % 250 for i in range(120)] for j in range(3)]  # each crosses into a 2nd block
    params = mixed_params(3, 20)
    expected, _ = run(LLM(tiny_v4, device="cpu", dtype="float32", kv_cache_blocks=8), prompts, params)
    drafter = TableDrafter([p + e for p, e in zip(prompts, expected)], 320, wrong=True)
    llm = LLM(tiny_v4, host=host_with(drafter), device="cpu", dtype="float32", kv_cache_blocks=3,
              speculative_config={"method": "table", "num_speculative_tokens": 2})  # fmt: skip
    tokens, _ = run(llm, prompts, params)
    assert tokens == expected
    assert llm.engine.stats()["preemptions"] > 0


def test_v3_ngram_matches_decoding(tmp_path):
    from deepinfer_core.testing.v3_checkpoint import TINY_V3_CONFIG, tiny_deepseek_v3

    tiny_deepseek_v3(tmp_path, seed=2, **TINY_V3_CONFIG)
    prompts = [[4, 5, 6, 7] * 8, _prompts(1, 30, 128)[0]]
    params = mixed_params(2, 24)
    expected, _ = run(LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8), prompts, params)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip
    tokens, metrics = run(llm, prompts, params)
    assert tokens == expected
    assert sum(m["spec_num_draft_tokens"] for m in metrics) > 0


# -- SmolLM2, real weights ----------------------------------------------------------------------------
@contextlib.contextmanager
def drafting_off(llm):
    engine = llm.engine
    spec, release = engine.spec, engine.scheduler.on_release
    engine.spec, engine.scheduler.on_release = None, None
    try:
        yield
    finally:
        engine.spec, engine.scheduler.on_release = spec, release


def test_smollm2_ngram_greedy_sampled_and_json_in_one_batch():
    pytest.importorskip("xgrammar")  # the serve extra; the core env has the engine alone
    from deepinfer_core.serve.grammar import GrammarCompiler

    llm = LLM("smollm2-135m-instruct", device="cpu", kv_cache_blocks=16, max_num_seqs=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip
    tok = llm.get_tokenizer()
    texts = [
        "<|im_start|>user\nRepeat this sentence twice: the cat sat on the warm mat by the door.<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_start|>user\nCount from one to ten in words.<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nGive a JSON object with a name and an age.<|im_end|>\n<|im_start|>assistant\n",
    ]
    prompts = [tok.encode(t) for t in texts]
    compiler = GrammarCompiler(tok, llm.engine.model.vocab_size, tok.stop_token_ids)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}  # fmt: skip

    def params():  # a grammar processor is stateful: a fresh one per run
        return [
            SamplingParams(max_tokens=28, temperature=0),
            SamplingParams(max_tokens=28, temperature=0.7, seed=11),
            SamplingParams(max_tokens=28, temperature=0, logits_processors=[compiler.json_schema(schema, "schema")]),
        ]

    with drafting_off(llm):
        expected, _ = run(llm, prompts, params())
    tokens, metrics = run(llm, prompts, params())
    assert tokens == expected
    assert sum(m["spec_num_accepted_tokens"] for m in metrics) > 0  # the repeat prompt is drafted well
    assert tok.decode(tokens[2]).lstrip().startswith("{")

    # the low-bit native step hands a drafter the same pre-norm hidden as the model's torch layers
    from deepinfer_core.engine.request import Request
    from deepinfer_core.engine.scheduler import ScheduledRequest, SchedulerOutput

    engine, model = llm.engine, llm.engine.model
    assert hasattr(model.fused_step, "run_hidden")
    ids = prompts[0]

    def hidden(fused):
        req = Request("probe", list(ids), SamplingParams(max_tokens=1), seed=0)
        assert engine.kv.allocate(req, len(ids))
        sched = SchedulerOutput((ScheduledRequest("probe", tuple(ids), 0, tuple(req.block_ids), False, 0),), len(ids))
        input_ids, meta, _ = engine.runner.build_batch(sched)
        saved, model.fused_step = model.fused_step, (model.fused_step if fused else None)
        try:
            return model.forward_hidden(input_ids, meta.positions, engine.runner.kv_caches, meta)[1]
        finally:
            model.fused_step = saved
            engine.kv.free(req)

    native, layers = hidden(True), hidden(False)
    assert (native - layers).abs().max() <= 1e-3 * layers.abs().max()


def test_bad_speculative_config_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_llama, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key 'gamma'"):
        LLM(tiny_llama, device="cpu", speculative_config={"method": "ngram", "gamma": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(tiny_llama, device="cpu", speculative_config="{method: ngram}")
    with pytest.raises(ValueError, match="no drafter named 'eagle'"):
        LLM(tiny_llama, device="cpu", speculative_config='{"method": "eagle"}')
    with pytest.raises(ValueError, match="needs a model with an MTP block"):
        LLM(tiny_llama, device="cpu", speculative_config={"method": "mtp"})


def test_metrics_endpoint_counts_what_the_requests_report(tiny_llama, llama_reference):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from deepinfer_core.serve.metrics import ServerMetrics

    prompts, params, expected = llama_reference
    drafter = TableDrafter([p + e for p, e in zip(prompts, expected)], 96, wrong=False)
    llm = LLM(
        tiny_llama, host=host_with(drafter), device="cpu", dtype="float32", block_size=16, kv_cache_blocks=64,
        speculative_config={"method": "table", "num_speculative_tokens": 3},
    )  # fmt: skip
    metrics = ServerMetrics("tiny")
    _, per_request = run(llm, prompts[:2], params[:2])
    metrics.on_step(llm.engine.stats())
    metrics.on_step(llm.engine.stats())  # mirrored by difference: counted once
    samples = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        for sample in family.samples:
            samples[(sample.name, sample.labels.get("position"))] = sample.value
    drafts = sum(m["spec_num_drafts"] for m in per_request)
    draft_tokens = sum(m["spec_num_draft_tokens"] for m in per_request)
    accepted = sum(m["spec_num_accepted_tokens"] for m in per_request)
    assert samples[("deepinfer:spec_decode_num_drafts_total", None)] == drafts
    assert samples[("deepinfer:spec_decode_num_draft_tokens_total", None)] == draft_tokens
    assert samples[("deepinfer:spec_decode_num_accepted_tokens_total", None)] == accepted == draft_tokens
    per_pos = [samples[("deepinfer:spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2] > 0


class HiddenProbe:
    """Records what the engine hands a drafter that reads the target's hidden state."""

    name = "probe"
    needs_hidden = True
    needs_token_ids = True

    def __init__(self) -> None:
        self.seen = []

    def propose(self, batch, num_tokens):
        self.seen.append((list(batch.token_ids[0]), int(batch.positions[0]), batch.hidden[0].clone()))
        R = batch.last_token_ids.shape[0]
        return torch.zeros(R, num_tokens, dtype=torch.long), torch.full((R, num_tokens), 0.5)


def test_drafter_hidden_is_the_pre_norm_state_that_produced_the_last_token(tiny_llama):
    """DraftBatch.hidden, checked with transformers: its final norm applied to our hidden equals
    transformers' last hidden state at ``positions - 1`` (the row whose logits gave the token)."""
    transformers = pytest.importorskip("transformers")
    probe = HiddenProbe()
    llm = LLM(tiny_llama, host=host_with(probe), device="cpu", dtype="float32", block_size=16, kv_cache_blocks=16,
              speculative_config={"method": "table", "num_speculative_tokens": 2})  # fmt: skip
    run(llm, [[3, 14, 15, 92, 65, 35]], [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)])
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert len(probe.seen) >= 2
    for tokens, pos, hidden in probe.seen:
        assert pos == len(tokens) - 1
        with torch.no_grad():
            ref = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states[-1][0, pos - 1]
            ours = hf.model.norm(hidden[None])[0]
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_speculative_config_on_the_command_line():
    import argparse

    from deepinfer_core.engine.config import engine_config
    from deepinfer_core.entrypoints.engine_options import add_engine_options, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = engine_config("m", **engine_kwargs(args)).speculative_config
    assert (config.method, config.num_speculative_tokens, config.verification) == ("ngram", 3, "fixed")
    assert engine_config("m", **engine_kwargs(parser.parse_args([]))).speculative_config is None
    with pytest.raises(ValueError, match="'verification' must be one of"):
        engine_config("m", speculative_config={"method": "ngram", "verification": 3})
