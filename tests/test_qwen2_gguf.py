"""Qwen2 / Qwen2.5 GGUF files (``general.architecture = qwen2``): the Llama layout with q/k/v
biases and no o bias, rows in Hugging Face's order, rope theta from the file, GQA, tied or untied
head, a byte-level BPE with Qwen2's split and a ChatML template.

The references are independent of deepinfer: a random transformers ``Qwen2ForCausalLM`` written
to GGUF the way llama.cpp's converter lays it out (``testing.gguf_files.write_hf_qwen2_gguf``),
transformers on the same weights and through its own GGUF loader, and llama.cpp
(llama-cpp-python) on the same file: its logits, greedy tokens and tokenization. Quantized files
(quantized by the ``gguf`` library) run on the CPU default (packed weights, one native call per
decode step) and are checked against the same file dequantized to float32.
"""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.chat_prompt import encode_chat
from deepinfer_core.lowbit import describe_weights
from deepinfer_core.testing.gguf_files import tiny_qwen2_vocab, write_hf_qwen2_gguf, write_random_llama_gguf
from deepinfer_core.testing.greedy_check import check_greedy

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # ~30 s in all on a 2-core machine: transformers, llama.cpp and two engines per file

VOCAB = len(tiny_qwen2_vocab()[0])
PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 7, 61)]
TEXTS = [
    " hello world 12345 and 2024",
    "the cat\n\nis a dog 007",
    "<|im_start|>user\nhi<|im_end|>\n",
    "ünïcödé 日本 🤖 x1y22",
]
CHATS = [
    [{"role": "user", "content": "hello world 12"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "a dog"},
        {"role": "user", "content": "<|im_end|> stays text"},
    ],
]


def _engine(path, **kw):
    return LLM(path, device="cpu", kv_cache_blocks=4, enable_prefix_caching=False, **kw)


def _qwen2(tied: bool, seed: int = 0):
    """A random Qwen2 (hidden 64, 4 heads over 2 KV heads, rope theta 1e6) with non-zero biases."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:  # o, down and the embedding wider, so layers and head do not just echo the token
                p.normal_(
                    0.0, (3.0 if any(k in name for k in ("o_proj", "down_proj", "embed")) else 1.0) / p.shape[-1] ** 0.5
                )
    return model


@pytest.fixture(scope="module", autouse=True)
def _no_cache(tmp_path_factory):
    """Each file is written once; the start-up cache is off so every test parses the file itself."""
    before = os.environ.get("DEEPINFER_GGUF_CACHE")
    os.environ["DEEPINFER_GGUF_CACHE"] = "0"
    yield
    if before is None:
        os.environ.pop("DEEPINFER_GGUF_CACHE")
    else:
        os.environ["DEEPINFER_GGUF_CACHE"] = before


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{(tied, type): path} and the transformers models they were written from."""
    folder = tmp_path_factory.mktemp("qwen2")
    models = {tied: _qwen2(tied) for tied in (False, True)}
    paths = {
        (tied, t): write_hf_qwen2_gguf(
            folder / f"qwen2_{'tied' if tied else 'untied'}_{t}.gguf", models[tied], type_name=t
        )
        for tied in (False, True)
        for t in ("F32", "Q8_0", "Q4_0")
    }
    return paths, models


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_config_and_layout_from_the_file(files):
    paths, models = files
    model = _engine(paths[(False, "F32")], dtype="float32").engine.model
    cfg = model.config
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["rope_theta"] == 1e6 and cfg["vocab_size"] == VOCAB
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (4, 2, False)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert _engine(paths[(True, "F32")], dtype="float32").engine.model.config["tie_word_embeddings"] is True


@pytest.mark.parametrize("tied", [False, True])
def test_float32_logits_and_greedy_tokens_equal_transformers(files, tied):
    paths, models = files
    llm = _engine(paths[(tied, "F32")], dtype="float32")
    for ids in PROMPTS:
        want = _hf_logits(models[tied], ids)
        assert (llm.engine.prompt_logits(ids) - want).abs().max().item() < 1e-4 * want.std().item() * 10
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):  # every token transformers' argmax on the same prefix (teacher-forced)
        full = list(ids) + list(out.outputs[0].token_ids)
        want = _hf_logits(models[tied], full[:-1])[len(ids) - 1 :].argmax(-1)
        assert want.tolist() == list(out.outputs[0].token_ids)


@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_transformers_gguf_loader_reads_the_same_model(files, type_name):
    """transformers' own GGUF reader (config, names, dequantization) on the same file."""
    paths, _ = files
    path = paths[(False, type_name)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    ours = _engine(path, dtype="float32").engine
    for ids in PROMPTS:
        want = _hf_logits(hf, ids)
        assert (ours.prompt_logits(ids) - want).abs().max().item() < 1e-3 * want.std().item()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("tied", [False, True])
def test_cpu_default_packs_and_follows_the_dequantized_model(files, type_name, tied):
    """The default (packed weights, one native call per decode step, q/k/v biases in it) vs the
    same file dequantized to float32: prompt logits close, greedy tokens the float32 argmax or
    within a near-tie of it, in one batch of mixed lengths."""
    paths, _ = files
    path = paths[(tied, type_name)]
    fast = _engine(path)
    dense = _engine(path, dtype="float32").engine
    assert describe_weights(fast.engine.model).startswith("low-bit")
    for ids in PROMPTS:
        want = dense.prompt_logits(ids)
        assert (fast.engine.prompt_logits(ids) - want).abs().max().item() < 0.05 * want.std().item()
    outs = fast.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert fast.engine.model.fused_step is not None  # the decode steps took the native plan
    report = check_greedy(dense, PROMPTS, [list(o.outputs[0].token_ids) for o in outs], tolerance=0.05)
    assert not report.misses and report.exact >= 0.9 * report.tokens, report


def test_llama_cpp_on_the_same_file(files):
    """llama.cpp's prompt logits on the float32 file equal ours; its greedy tokens on the Q8_0 file
    are our float32 model's argmax (teacher-forced) as ours are."""
    llama_cpp = pytest.importorskip("llama_cpp")
    paths, _ = files
    ids = PROMPTS[0]
    lm = llama_cpp.Llama(
        paths[(False, "F32")], n_ctx=256, n_threads=1, logits_all=True, verbose=False, type_k=0, type_v=0
    )
    lm.eval(ids)
    want = torch.tensor(lm.scores[: len(ids)], dtype=torch.float32)
    ours = _engine(paths[(False, "F32")], dtype="float32").engine.prompt_logits(ids)
    assert (ours - want).abs().max().item() < 1e-2 * want.std().item()

    path = paths[(False, "Q8_0")]
    lm = llama_cpp.Llama(path, n_ctx=256, n_threads=1, verbose=False)
    theirs = []
    for p in PROMPTS:
        toks = []
        for tok in lm.generate(p, temp=0.0, top_k=1, reset=True):
            toks.append(int(tok))
            if len(toks) == 16:
                break
        theirs.append(toks)
    dense = _engine(path, dtype="float32").engine
    report = check_greedy(dense, PROMPTS, theirs, tolerance=0.1)
    assert report.exact >= 0.9 * report.tokens, report


def test_tokenizer_and_chat_template_from_the_file(files):
    """Qwen2's split (single digits), control tokens and ChatML: our ids equal llama.cpp's and
    transformers' GGUF tokenizer's; the chat prompt equals transformers' template rendering and
    its ids; <|im_end|> stops generation."""
    llama_cpp = pytest.importorskip("llama_cpp")
    paths, _ = files
    path = paths[(False, "F32")]
    tok = _engine(path, dtype="float32").get_tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    lm = llama_cpp.Llama(path, n_ctx=64, verbose=False, vocab_only=True)
    for text in TEXTS:
        ours = tok.encode(text)
        assert (
            ours == lm.tokenize(text.encode(), add_bos=False, special=True) == hf.encode(text, add_special_tokens=False)
        ), text
    assert tok.encode("12345") == [
        tok.token_to_id(c) for c in "12345"
    ]  # the "1 2", "12 3" merges never apply across digits
    for chat in CHATS:
        ids, text = encode_chat(tok, chat)
        assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        if "<|im_end|>" not in chat[-1]["content"]:
            assert (
                ids
                == hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True)[
                    "input_ids"
                ]
            )
    assert (
        ids.count(tok.token_to_id("<|im_end|>")) == 4
    )  # four turns; the text "<|im_end|>" in the last message stayed text
    assert tok.token_to_id("<|im_end|>") in tok.stop_token_ids and tok.encode(
        "x", add_special_tokens=True
    ) == tok.encode("x")


def test_llama_arch_with_q_k_v_biases_and_no_o_bias(tmp_path, files):
    """The cpucheck failure ("missing o_proj.bias"): a llama-architecture file with q/k/v biases
    only loads on both paths and gives llama.cpp's logits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    paths, _ = files
    path = write_random_llama_gguf(
        tmp_path / "qkv_bias.gguf",
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        layers=2,
        vocab=VOCAB,
        tied=False,
        types={"*": "Q8_0"},
        attention_bias=True,
        o_bias=False,
        tokenizer_from=paths[(False, "F32")],
    )
    lm = llama_cpp.Llama(path, n_ctx=256, n_threads=1, logits_all=True, verbose=False, type_k=0, type_v=0)
    ids = PROMPTS[0]
    lm.eval(ids)
    want = torch.tensor(lm.scores[: len(ids)], dtype=torch.float32)
    dense = _engine(path, dtype="float32")
    assert dense.engine.model.model.layers[0].self_attn.o_proj.bias is None
    ours = dense.engine.prompt_logits(ids)
    fast = _engine(path).engine.prompt_logits(ids)
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    assert (ours - want).abs().max().item() < 0.1 * want.std().item()
    assert (fast - ours).abs().max().item() < 0.05 * ours.std().item()


def test_hugging_face_qwen2_directory(tmp_path, files):
    """The same architecture from a transformers ``save_pretrained`` directory (safetensors, a
    Qwen2 config without any bias key)."""
    _, models = files
    models[True].save_pretrained(tmp_path)
    ids = PROMPTS[2]
    want = _hf_logits(models[True], ids)
    ours = _engine(str(tmp_path), dtype="float32").engine.prompt_logits(ids)
    assert (ours - want).abs().max().item() < 1e-3 * want.std().item()


def test_cli_generate_chat_on_a_qwen2_gguf(files, capsys):
    """``deepinfer generate --chat`` (in-process) on a Q8_0 qwen2 file: the file's ChatML prompt,
    as many prompt tokens as transformers' GGUF tokenizer gives, the offline chat's greedy text."""
    import json

    from deepinfer_core.entrypoints.main import main

    paths, _ = files
    path = paths[(True, "Q8_0")]
    status = main(
        [
            "generate",
            "--model",
            path,
            "--device",
            "cpu",
            "--kv-cache-blocks",
            "8",
            "--max-tokens",
            "6",
            "--chat",
            "--json",
            "hello world 12",
        ]
    )
    assert status == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    chat = [{"role": "user", "content": "hello world 12"}]
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    want = _engine(path).chat(chat, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert got["text"] == want, got
    assert got["prompt_tokens"] == len(
        hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
