"""DeepSeek-V4 through the public offline API, against transformers' ``DeepseekV4ForCausalLM``.

A tiny random config has every attention kind (sliding, compressed sparse with its indexer,
heavily compressed), hash-routed and learned MoE layers and 3 hyper-connection streams; the
window (16), compress rates (4 / 16) and index_topk (6) are small so that prompts of up to 1,500
tokens span many windows, compressed entries and 128-token KV blocks. Parameters transformers
initialises to zero (sinks, position biases, mHC biases, the hash table) are randomised so a
mistake in them shows.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.fail("transformers >= 5.24 (DeepseekV4) is required for the DeepSeek-V4 tests")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.testing.v4_tiny import TINY_V4_KWARGS, save_tiny_v4, tiny_v4_config  # noqa: E402

PROMPT_LENS = [10, 37, 130, 257, 600, 900, 1200, 1500]
NEW = 12
VOCAB = TINY_V4_KWARGS["vocab_size"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4")
    return path, save_tiny_v4(path, seed=1234, randomise_seed=5)  # eos cleared: full-length continuations


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint[0]), device="cpu", dtype="float32", kv_cache_blocks=64)


def prompts(lens=PROMPT_LENS, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lens]


def greedy(max_tokens=NEW):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_tokens(checkpoint):
    _, hf = checkpoint
    out = []
    with torch.no_grad():
        for p in prompts():
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=NEW,
                do_sample=False,
            )
            out.append(ref[0, len(p) :].tolist())
    return out


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_match_transformers_generate(llm, reference_tokens):
    assert tokens(llm.generate(prompts(), greedy())) == reference_tokens


def test_logits_match_transformers_at_every_prompt_position(llm, checkpoint):
    _, hf = checkpoint
    for p in prompts():
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        ours = llm.engine.prompt_logits(p)
        assert (ours - ref).abs().max().item() < 1e-4, f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("budget", [64, 128, 1000])
def test_chunked_prefill_gives_the_same_tokens(checkpoint, reference_tokens, budget):
    llm = LLM(str(checkpoint[0]), device="cpu", dtype="float32", kv_cache_blocks=64, max_num_batched_tokens=budget)
    assert tokens(llm.generate(prompts(), greedy())) == reference_tokens


def test_mixed_batch_equals_each_request_alone(llm):
    ps = prompts([3, 9, 16, 17, 31, 64, 100, 127, 128, 129, 150, 200, 255, 256, 300, 400], seed=11)
    batched = tokens(llm.generate(ps, greedy(10)))
    alone = [tokens(llm.generate([p], greedy(10)))[0] for p in ps]
    assert batched == alone


def test_preemption_under_a_small_pool_keeps_outputs(checkpoint, llm):
    ps = prompts([120, 250, 370, 120], seed=13)  # the first three fill 6 blocks; growing needs a 7th
    want = tokens(llm.generate(ps, greedy(40)))
    tight = LLM(str(checkpoint[0]), device="cpu", dtype="float32", kv_cache_blocks=6)
    got = tokens(tight.generate(ps, greedy(40)))
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want


def test_repeated_prompt_reports_cached_tokens_and_same_output(checkpoint, reference_tokens):
    llm = LLM(str(checkpoint[0]), device="cpu", dtype="float32", kv_cache_blocks=96)
    first = llm.generate(prompts(), greedy())
    again = llm.generate(prompts(), greedy())
    assert [o.num_cached_tokens for o in again] == [(n - 1) // 128 * 128 for n in PROMPT_LENS]
    assert tokens(first) == reference_tokens
    assert tokens(again) == reference_tokens


def test_prefix_hit_with_a_new_suffix_matches_transformers(checkpoint):
    # The hit covers 384 tokens; the state (windows, compressor tails) at 384 is rebuilt by
    # replay, then 150 new prompt tokens run on it.
    _, hf = checkpoint
    llm = LLM(str(checkpoint[0]), device="cpu", dtype="float32", kv_cache_blocks=32)
    base = prompts([400], seed=21)[0]
    llm.generate([base], greedy(2))
    branch = base[:384] + prompts([150], seed=22)[0]
    out = llm.generate([branch], greedy(16))[0]
    assert out.num_cached_tokens == 384
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([branch]),
            attention_mask=torch.ones(1, len(branch), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
        )
    assert out.outputs[0].token_ids == ref[0, len(branch) :].tolist()


@pytest.mark.parametrize(
    ("edit", "names"),
    [
        (
            {"layer_types": ["sliding_attention", "dense_attention"] + ["sliding_attention"] * 3},
            ["layer_types", "dense_attention"],
        ),
        ({"layer_types": ["sliding_attention"] * 3}, ["layer_types", "3", "5"]),
        ({"compress_ratios": [0, 4, 7, 4, 128], "layer_types": None}, ["compress_ratios", "7"]),
        ({"mlp_layer_types": ["moe", "dense"] + ["moe"] * 3}, ["mlp_layer_types", "dense"]),
        ({"o_groups": 3}, ["o_groups", "3", "num_attention_heads"]),
        ({"num_key_value_heads": 2}, ["num_key_value_heads"]),
        ({"num_experts_per_tok": 9}, ["num_experts_per_tok", "n_routed_experts"]),
        ({"scoring_func": "relu"}, ["scoring_func", "sqrtsoftplus"]),
    ],
)
def test_bad_config_is_named_before_anything_is_built(edit, names):
    from deepinfer_core.models.deepseek_v4.config import parse_config

    config = tiny_v4_config().to_dict() | edit
    with pytest.raises(ValueError) as err:
        parse_config({k: v for k, v in config.items() if v is not None})
    assert all(n in str(err.value) for n in names), str(err.value)


def test_block_size_must_hold_whole_compression_windows():
    from deepinfer_core.models.deepseek_v4.kv import v4_kv_layout

    with pytest.raises(ValueError, match="compresses every 16 tokens.*block size 24"):
        v4_kv_layout(tiny_v4_config().to_dict(), torch.float32, block_size=24)
    layout = v4_kv_layout(tiny_v4_config().to_dict(), torch.float32, block_size=128)
    # per block: CSA 32 entries x (32 + 16), HCA 8 entries x 32, two of each; float32
    assert layout.block_bytes == 4 * (2 * 32 * 48 + 2 * 8 * 32)
    assert layout.exact_replay_tokens == 4 * 15 + 16


@pytest.mark.parametrize("budget", [70, 1000])
def test_chunked_prefill_with_tied_index_scores_matches_transformers(tmp_path, budget):
    # Two index heads: relu makes many index scores exactly 0, so top-k meets exact ties; chunks
    # of 70 tokens are not multiples of the compress rates. Prompt rows must rank the entries as
    # transformers' one-pass prefill does, whatever the chunking.
    hf = save_tiny_v4(tmp_path, seed=99, randomise_seed=6, config=tiny_v4_config(index_n_heads=2, index_topk=3))
    ps = prompts([130, 333, 517], seed=17)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=32, max_num_batched_tokens=budget)
    got = tokens(llm.generate(ps, greedy(8)))
    with torch.no_grad():
        want = [
            hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
            )[0, len(p) :].tolist()
            for p in ps
        ]
    assert got == want


def test_each_forward_computes_a_rope_once_per_positions(llm, monkeypatch):
    # The layers of one forward share their cos / sin (StepRope): no (rope, positions, dtype)
    # is computed twice in a forward, and the logits are the per-layer ones bit for bit.
    from deepinfer_core.models.deepseek_v4 import layers as v4_layers
    from deepinfer_core.models.deepseek_v4 import model as v4_model

    p = prompts([600], seed=19)[0]
    want = llm.engine.prompt_logits(p)
    calls = []
    original = v4_layers.V4Rope.cos_sin

    def counted(self, positions, dtype):
        calls.append((id(self), tuple(positions.tolist()), dtype))
        return original(self, positions, dtype)

    monkeypatch.setattr(v4_layers.V4Rope, "cos_sin", counted)
    assert torch.equal(llm.engine.prompt_logits(p), want)
    assert calls and len(calls) == len(set(calls)), "a forward computed the same rope twice"
    calls.clear()
    monkeypatch.setattr(v4_model, "step_ropes", lambda ropes: ropes)  # every layer its own (as before)
    assert torch.equal(llm.engine.prompt_logits(p), want)
    assert len(calls) > len(set(calls))  # the count above can fail: without the views it repeats
