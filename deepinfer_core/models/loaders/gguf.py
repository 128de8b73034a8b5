"""Open a llama.cpp GGUF file as :class:`ModelFiles` with Hugging Face names and layouts.

A GGUF carries its config and tokenizer as metadata and its tensors in llama.cpp's naming,
often block-quantized (Q4_1, Q8_0...). We dequantize to float32 (the reference path computes in
float32) and undo the one layout change llama.cpp's converter makes for the ``llama``
architecture: it reorders the rows of the Q and K projections (weights and biases) of every
head from the rotate-half pairing (i, i + d/2) to interleaved pairs (2i, 2i + 1)::

    HF rows of one head   [x0 x1 .. x(d/2-1) | y0 y1 .. y(d/2-1)]
    GGUF rows             [x0 y0 x1 y1 .. x(d/2-1) y(d/2-1)]

``qwen2`` files (Qwen2, Qwen2.5) keep Hugging Face's order (llama.cpp rotates them with the
rotate-half "NEOX" pairing) and carry q/k/v biases without an o bias: the same model, read as
``Qwen2ForCausalLM``, rows as stored.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from ...weight_format import QuantizedTensor
from . import gguf_cache
from .files import FileFormat, ModelFiles
from .gguf_cache import GGUFParts
from .gguf_index import read_index

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
PERMUTED_QK = frozenset({"llama"})  # architectures whose q/k rows llama.cpp's converter interleaves

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
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})  # GGML types stored as floats (every other is block-quantized)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_SAMPLE_BYTES = 1 << 20
ROPE_FREQS = "rope_freqs.weight"  # per-frequency divisors of the rotary frequencies, read into the config
SAMPLING_PREFIX = "general.sampling."  # the model's recommended sampling (temp, top_p, top_k...)


def open_gguf(path: str, *, cache: bool = True) -> ModelFiles:
    """Config, tokenizer and tensor index now; tensors are read (and dequantized, for the float
    stream) only when streamed. With ``cache`` (the default) a start-up cache entry of this file
    (see :mod:`.gguf_cache`) replaces the header parse and the tokenizer build, and the float
    weights once a first complete stream has written them."""
    entry = gguf_cache.entry_for(path) if cache else None
    parts = gguf_cache.read_entry(entry) if entry is not None else None
    if parts is None:
        parts = parse_gguf(path)
        if entry is not None:
            gguf_cache.write_entry(entry, parts)
    files = files_from_parts(path, parts)
    return files if entry is None else gguf_cache.cached_weights(files, entry)


GGUF_FILE = FileFormat("GGUF file", open_gguf, suffix=".gguf")


def parse_gguf(path: str) -> GGUFParts:
    """Everything a start-up needs from the file's header (the cold path: the metadata walk
    and the tokenizer build)."""
    from ...tokenizer import Tokenizer

    index = read_index(path)
    meta = index.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    config = llama_config(meta, arch, {t.name: t.shape for t in index.tensors})
    factors = next((t for t in index.tensors if t.name == ROPE_FREQS), None)
    if factors is not None:  # Llama 3.1+: llama.cpp's converter writes the llama3 scaling as this tensor
        if config["rope_scaling"] is not None:
            raise NotImplementedError(
                f"{path}: a {ROPE_FREQS} tensor together with rope scaling {config['rope_scaling']['rope_type']!r} "
                "is not supported"
            )
        import gguf

        values = gguf.quants.dequantize(factors.data(index.map()), gguf.GGMLQuantizationType[factors.type_name])
        config["rope_scaling"] = {
            "rope_type": "freq_factors",
            "freq_factors": [float(v) for v in np.asarray(values).reshape(-1)],
        }
    tokenizer = Tokenizer.from_gguf(meta) if meta.get("tokenizer.ggml.model") == "gpt2" else None
    sampling = {k: v for k, v in meta.items() if k.startswith(SAMPLING_PREFIX)}
    return GGUFParts(config, tokenizer, gguf_fingerprint(path, index.data_offset), sampling, index.tensors)


def files_from_parts(path: str, parts: GGUFParts) -> ModelFiles:
    """The weight streams over ``path``'s tensors as ``parts`` indexes them (one memmap)."""
    import gguf

    check_tensor_types(path, parts.tensors)  # also for a start-up cache entry
    config = parts.config
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = config.get("model_type", "llama") in PERMUTED_QK

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        file = np.memmap(path, dtype=np.uint8, mode="r")
        for t in parts.tensors:
            if t.name == ROPE_FREQS:
                continue
            name = hf_name(t.name)
            data = gguf.quants.dequantize(t.data(file), gguf.GGMLQuantizationType[t.type_name])
            yield name, rotary_order(name, torch.from_numpy(np.array(data, dtype=np.float32).reshape(t.shape)))

    def rotary_order(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Q and K rows (weights and biases: llama.cpp's converter permutes both) back in
        Hugging Face's rotate-half order."""
        if not permuted:
            return tensor
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return unpermute_rotary_rows(tensor, heads)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return unpermute_rotary_rows(tensor, kv_heads)
        return tensor

    def quantized_weights() -> Iterator[tuple[str, Any]]:
        """Block-quantized 2-D tensors as stored (:class:`QuantizedTensor`: GGML type, shape,
        raw bytes and the rotary row order; a weight format packs them, never a float copy);
        float tensors (norms) as in ``weights``."""
        file = np.memmap(path, dtype=np.uint8, mode="r")
        for t in parts.tensors:
            if t.name == ROPE_FREQS:
                continue
            name = hf_name(t.name)
            if t.type_name in FLOAT_TYPES or len(t.shape) != 2:
                data = gguf.quants.dequantize(t.data(file), gguf.GGMLQuantizationType[t.type_name])
                yield name, rotary_order(name, torch.from_numpy(np.array(data, dtype=np.float32).reshape(t.shape)))
                continue
            rows = torch.arange(t.shape[0])
            order = rotary_order(name, rows)  # q/k rows of a permuted architecture move as whole rows
            yield name, QuantizedTensor(t.type_name, tuple(t.shape), t.data(file), None if order is rows else order)

    packed = [t for t in parts.tensors if t.type_name not in FLOAT_TYPES and len(t.shape) == 2]
    quantized = frozenset(hf_name(t.name) for t in packed)
    return ModelFiles(
        config=config,
        weights=weights,
        tokenizer=parts.tokenizer,
        source=path,
        fingerprint=parts.fingerprint,
        quantized_weights=quantized_weights if quantized else None,
        quantized_names=quantized,
        sampling=dict(parts.sampling),
        quantized_types=frozenset(t.type_name for t in packed),
    )


def check_tensor_types(path: str, tensors) -> None:
    """Refuse, before anything is allocated, a file with a tensor type that neither the packed
    formats nor the ``gguf`` library's dequantizer can read (it names the type and a tensor),
    instead of failing halfway through the weight stream."""
    import gguf

    seen: dict[str, str] = {}
    for t in tensors:
        seen.setdefault(t.type_name, t.name)
    for type_name, name in seen.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, nbytes), dtype=np.uint8), qtype)
        except NotImplementedError as exc:
            raise NotImplementedError(
                f"{path}: tensor {name} is {type_name}, a type this deepinfer cannot read ({exc}); "
                "re-quantize the file to a common type (Q4_K_M, Q5_K_M, Q8_0, ...)"
            ) from None


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


def llama_config(meta: Mapping[str, Any], arch: str, tensors: Mapping[str, tuple[int, ...]]) -> dict:
    """Hugging Face ``LlamaConfig``-style dict from ``{arch}.*`` metadata keys; ``tensors``: the
    file's tensor names (and shapes, [rows, cols], where known)."""
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    tensor_names = set(tensors)
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    vocab = key("vocab_size")
    embed = tensors.get("token_embd.weight")
    if vocab is None and embed:  # llama.cpp's converters write no vocab_size key for most architectures (qwen2)
        vocab = embed[0]
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
        "o_proj_bias": "blk.0.attn_output.bias" in tensor_names,  # Qwen2 and some Llama fine-tunes: q/k/v biases only
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


def gguf_fingerprint(path: str, data_offset: int) -> str:
    """sha256 over the header (metadata + tensor index, the first ``data_offset`` bytes), the
    file size and the first and last MiB of tensor data: cheap on a multi-GB file, and two
    checkpoints with the same shapes (a fine-tune) still differ in their data samples."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(data_offset))
        h.update(f.read(_SAMPLE_BYTES))
        f.seek(max(data_offset, size - _SAMPLE_BYTES))
        h.update(f.read(_SAMPLE_BYTES))
    return "gguf-sha256:" + h.hexdigest()
