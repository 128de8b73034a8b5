"""Open a llama.cpp GGUF file as :class:`ModelFiles` with Hugging Face names and layouts.

A GGUF carries its config and tokenizer as metadata and its tensors in llama.cpp's naming,
often block-quantized (Q4_1, Q8_0...). We dequantize to float32 (the reference path computes in
float32) and undo the one layout change llama.cpp's converter makes: it reorders the rows of the
Q and K projections of every head from the rotate-half pairing (i, i + d/2) to interleaved pairs
(2i, 2i + 1)::

    HF rows of one head   [x0 x1 .. x(d/2-1) | y0 y1 .. y(d/2-1)]
    GGUF rows             [x0 y0 x1 y1 .. x(d/2-1) y(d/2-1)]
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Iterator

import numpy as np
import torch

from ..lowbit.formats import FLOAT_TYPES, from_gguf
from .files import ModelFiles

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_SAMPLE_BYTES = 1 << 20


def open_gguf(path: str, *, cache: bool = True) -> ModelFiles:
    """Read metadata and tensor index now; tensors are dequantized only when streamed. With
    ``cache`` (the default), a start-up cache entry of this file is used when there is one and
    written by the first complete weight stream otherwise (see :mod:`.gguf_cache`)."""
    import gguf

    from .gguf_cache import caching, entry_for, open_cached

    entry = entry_for(path) if cache else None
    if entry is not None:
        hit = open_cached(entry, path, lambda p: open_gguf(p, cache=False))
        if hit is not None:
            return hit

    from ..tokenizer import Tokenizer

    reader = gguf.GGUFReader(path)
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    tensor_names = {t.name for t in reader.tensors}
    config = llama_config(meta, arch, tensor_names)
    tokenizer = Tokenizer.from_gguf(reader) if meta.get("tokenizer.ggml.model") == "gpt2" else None
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            name = hf_name(t.name)
            shape = tuple(reversed([int(d) for d in t.shape]))  # GGUF lists dims fastest-first
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            tensor = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
            if name.endswith("self_attn.q_proj.weight"):
                tensor = unpermute_rotary_rows(tensor, heads)
            elif name.endswith("self_attn.k_proj.weight"):
                tensor = unpermute_rotary_rows(tensor, kv_heads)
            yield name, tensor

    def quantized_weights() -> Iterator[tuple[str, Any]]:
        """Block-quantized tensors packed for the low-bit kernels (never dequantized to a
        float copy); float tensors (norms) as in ``weights``."""
        for t in reader.tensors:
            name = hf_name(t.name)
            shape = tuple(reversed([int(d) for d in t.shape]))
            if t.tensor_type.name in FLOAT_TYPES or len(shape) != 2:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
                yield name, torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
                continue
            packed = from_gguf(t.tensor_type.name, t.data, shape)
            if name.endswith("self_attn.q_proj.weight"):
                packed = packed.rows(unpermute_rotary_rows(torch.arange(shape[0]), heads))
            elif name.endswith("self_attn.k_proj.weight"):
                packed = packed.rows(unpermute_rotary_rows(torch.arange(shape[0]), kv_heads))
            yield name, packed

    quantized = frozenset(
        hf_name(t.name) for t in reader.tensors if t.tensor_type.name not in FLOAT_TYPES and len(t.shape) == 2
    )
    files = ModelFiles(
        config=config, weights=weights, tokenizer=tokenizer, source=path, fingerprint=gguf_fingerprint(path, reader),
        quantized_weights=quantized_weights if quantized else None, quantized_names=quantized,
    )
    return files if entry is None else caching(files, entry)


def hf_name(gguf_name: str) -> str:
    """Hugging Face name of a llama.cpp tensor; unknown names pass through unchanged so the
    model's ``load_weights`` reports them as unexpected instead of them vanishing silently."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return gguf_name


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[H*d, in] in llama.cpp's interleaved row order -> Hugging Face's rotate-half order."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama_config(meta: "_Metadata", arch: str, tensor_names: set[str]) -> dict:
    """Hugging Face ``LlamaConfig``-style dict from ``{arch}.*`` metadata keys."""
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    vocab = key("vocab_size")
    if vocab is None:  # older files only list the tokens
        vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(key("context_length", 2048)),
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    rope_dims = key("rope.dimension_count", head_dim)
    if int(rope_dims) != head_dim:
        config["partial_rotary_factor"] = int(rope_dims) / head_dim
    scaling_type = key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        # Passed on as stated; the model refuses types it does not implement.
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(key("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": key("rope.scaling.original_context_length"),
        }
    return config


def gguf_fingerprint(path: str, reader: Any) -> str:
    """sha256 over the header (metadata + tensor index), the file size and the first and last MiB
    of tensor data: cheap on a multi-GB file, and two checkpoints with the same shapes (a
    fine-tune) still differ in their data samples."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(reader.data_offset))
        h.update(f.read(_SAMPLE_BYTES))
        f.seek(max(reader.data_offset, size - _SAMPLE_BYTES))
        h.update(f.read(_SAMPLE_BYTES))
    return "gguf-sha256:" + h.hexdigest()


class _Metadata:
    """Plain Python values of a reader's metadata fields (strings decoded, arrays as lists)."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields

    def get(self, name: str, default: Any = None) -> Any:
        f = self._fields.get(name)
        return default if f is None else f.contents()
