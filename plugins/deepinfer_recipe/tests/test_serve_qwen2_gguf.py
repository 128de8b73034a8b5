"""``deepinfer serve`` on a Qwen2 GGUF (``general.architecture = qwen2``, Q8_0, the CPU default):
the chat prompt comes from the file's own ChatML template and tokenizer. Checked with the
official ``openai`` SDK against transformers' GGUF tokenizer (the prompt's token count) and
the offline ``LLM.chat`` (the same greedy text, streamed and not)."""

from __future__ import annotations

import os

import pytest

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

MESSAGES = [
    [{"role": "user", "content": "hello world 12"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat and the dog"}],
]


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory):
    import torch

    from deepinfer_core.testing.gguf_files import tiny_qwen2_vocab, write_hf_qwen2_gguf

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=len(tiny_qwen2_vocab()[0]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=1e6,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    return write_hf_qwen2_gguf(tmp_path_factory.mktemp("qwen2_serve") / "qwen2_q8_0.gguf", model, type_name="Q8_0")


def test_chat_on_a_qwen2_gguf(qwen2_file):
    from serve_harness import start_in_thread

    from deepinfer_core import LLM, SamplingParams

    hf_tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(qwen2_file), gguf_file=os.path.basename(qwen2_file)
    )
    server = start_in_thread(model=qwen2_file, model_name="qwen2", dtype="auto")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        offline = LLM(qwen2_file, device="cpu", kv_cache_blocks=8)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for messages in MESSAGES:
            kw = dict(model="qwen2", messages=messages, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
            reply = client.chat.completions.create(**kw)
            streamed = "".join(
                c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices
            )
            want = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
            assert reply.usage.prompt_tokens == len(want) and reply.usage.completion_tokens == 8
            assert reply.choices[0].message.content == streamed == offline.chat(messages, params)[0].outputs[0].text
    finally:
        server.stop()
