"""Write GGUF variants of a checkpoint for tests and benchmarks (the ``gguf`` library's own
quantizers, so the reference never comes from deepinfer's code).

``write_tiny_llama_gguf(path, {"general.sampling.temp": 0.5})`` writes a two-tensor llama GGUF
(no tokenizer) with extra float keys, for loader and cache tests.

``write_hf_qwen2_gguf(path, model)`` writes a transformers ``Qwen2ForCausalLM`` as llama.cpp's
converter lays it out (``qwen2.*`` keys, q/k/v biases, rows as stored), with the small ChatML
vocabulary of :func:`tiny_qwen2_vocab`.

``requantize_gguf(src, dst, "Q8_0")`` dequantizes every block-quantized tensor of ``src`` and
quantizes it again with ``gguf.quants.quantize``: the result is what llama.cpp's converter would
write from those float weights. Metadata is copied, ``general.file_type`` updated.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "CHATML_TEMPLATE",
    "random_tensor",
    "requantize_gguf",
    "tiny_qwen2_vocab",
    "write_hf_qwen2_gguf",
    "write_random_llama_gguf",
    "write_tiny_llama_gguf",
]


_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "F32": 0}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def requantize_gguf(src: str, dst: str, type_name: str = "Q8_0") -> str:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = _FILE_TYPES[type_name] if key == "general.file_type" else field.contents()
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.tensor_type.name in ("F32", "F16", "BF16") or len(shape) != 2:
            writer.add_tensor(t.name, values)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def write_tiny_llama_gguf(path: str, float_keys: dict[str, float], seed: int = 0) -> str:
    """A llama GGUF of one Q8_0 embedding [32, 64] and one F32 norm, plus ``float_keys``
    (``general.sampling.*``...) as float32 values, written by the ``gguf`` library's writer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "embedding_length": 64,
        "feed_forward_length": 128,
        "block_count": 1,
        "attention.head_count": 2,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    for key, value in float_keys.items():
        writer.add_float32(key, value)
    w = np.random.default_rng(seed).standard_normal((32, 64)).astype(np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(w, q8), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


# -- random Llama GGUFs of any shape and tensor type (benchmarks/cpu/cpu_gguf_check.py) -------------
# Where each type keeps its f16 super-scales inside a block (byte offsets; llama.cpp's ggml-common.h):
# the K-quants and IQ4 have no quantizer in the gguf library, so their blocks are random bytes with
# these fields set to a scale that gives the wanted spread (every code pattern is a valid block).
_RAW_SCALES = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ2_XXS": (0,),
    "TQ2_0": (64,),
}
_BLOCK_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_tensor(rng, type_name: str, shape: tuple[int, int], std: float):
    """(data, raw_dtype) of a [N, K] tensor of ``type_name`` whose values have about ``std``
    spread: float types and the gguf library's quantizers from normal values, the others from
    random blocks (:data:`_RAW_SCALES`)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    n, k = shape
    if k % gguf.GGML_QUANT_SIZES[qtype][0]:
        raise ValueError(
            f"{type_name} packs blocks of {gguf.GGML_QUANT_SIZES[qtype][0]} values; a row of {k} does not divide"
        )
    if type_name in _RAW_SCALES:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
        one = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
        for offset in _RAW_SCALES[type_name]:
            raw[..., offset : offset + 2] = one
        spread = float(np.asarray(gguf.quants.dequantize(raw.reshape(n, -1), qtype)).std()) or 1.0
        scale = np.frombuffer(np.float16(std / spread).tobytes(), dtype=np.uint8)
        for offset in _RAW_SCALES[type_name]:
            raw[..., offset : offset + 2] = scale
        return raw.reshape(n, -1), qtype
    values = (rng.standard_normal((n, k)) * std).astype(np.float32)
    if type_name not in (
        "F32",
        "F16",
        "BF16",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
    ):  # no quantizer, no known layout: zero blocks
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((n, k // block * nbytes), dtype=np.uint8), qtype
    if type_name == "F32":
        return values, None
    if type_name == "F16":
        return values.astype(np.float16), None
    return gguf.quants.quantize(values, qtype), qtype


def write_random_llama_gguf(
    path: str,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    layers: int,
    vocab: int,
    tied: bool,
    types: dict[str, str],
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tokenizer_from: str | None = None,
    attention_bias: bool = False,
    seed: int = 0,
    arch: str = "llama",
    o_bias: bool | None = None,
    tokenizer_pre: str | None = None,
) -> str:
    """A random-weight Llama GGUF written by the ``gguf`` library's writer. ``types`` maps a role
    (``token_embd``, ``output``, ``attn_q`` ... ``ffn_down``, or ``"*"`` for the rest) to a GGUF type
    name; ``rope_scaling`` a llama3 dict (factor, low_freq_factor, high_freq_factor,
    original_context_length) written as llama.cpp does (a ``rope_freqs`` tensor). ``tokenizer_from``:
    a GGUF whose ``tokenizer.*`` keys are copied (then ``vocab`` must be at least its token count;
    extra tokens are appended as ``<extra_i>``); without it the file has no tokenizer.
    ``attention_bias``: q/k/v biases too, and an o bias unless ``o_bias`` says otherwise.
    ``arch="qwen2"``: a Qwen2 file (``qwen2.*`` keys; with ``attention_bias`` no o bias by default);
    ``tokenizer_pre`` replaces the copied ``tokenizer.ggml.pre`` (``"qwen2"``'s split)."""
    import gguf

    rng = np.random.default_rng(seed)
    kind = lambda role: types.get(role, types.get("*", "Q8_0"))  # noqa: E731
    o_bias = (attention_bias and arch == "llama") if o_bias is None else o_bias
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    if tokenizer_from is not None:
        _copy_tokenizer(writer, tokenizer_from, vocab, pre=tokenizer_pre)
    tensors: list[tuple[str, str, tuple[int, ...], float]] = [
        ("token_embd.weight", kind("token_embd"), (vocab, hidden), 3.0 / hidden**0.5)
    ]
    if not tied:
        tensors.append(("output.weight", kind("output"), (vocab, hidden), 3.0 / hidden**0.5))
    tensors.append(("output_norm.weight", "F32", (hidden,), 0.0))
    if rope_scaling is not None:
        tensors.append(("rope_freqs.weight", "F32", (head_dim // 2,), 0.0))
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {
        "attn_q": (q, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, q),
        "ffn_gate": (intermediate, hidden),
        "ffn_up": (intermediate, hidden),
        "ffn_down": (hidden, intermediate),
    }
    for i in range(layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", "F32", (hidden,), 0.0),
            (f"blk.{i}.ffn_norm.weight", "F32", (hidden,), 0.0),
        ]
        if attention_bias:  # in llama.cpp's row order, like the weights
            roles = ("attn_q", "attn_k", "attn_v") + (("attn_output",) if o_bias else ())
            tensors += [(f"blk.{i}.{role}.bias", "F32", (shapes[role][0],), 0.5) for role in roles]
        # o and down 3x wider than 1/sqrt(K): the layers outweigh the token's own embedding in the
        # residual, so a tied head does not just repeat the last token
        tensors += [
            (
                f"blk.{i}.{role}.weight",
                kind(role),
                shapes[role],
                (3.0 if role in ("attn_output", "ffn_down") else 1.0) / shapes[role][1] ** 0.5,
            )
            for role in _BLOCK_ROLES
        ]
    for name, type_name, shape, std in tensors:
        if len(shape) == 1:
            if name == "rope_freqs.weight":
                values = _llama3_rope_factors(rope_scaling, head_dim, rope_theta)
            elif name.endswith(".bias"):
                values = (std * rng.standard_normal(shape)).astype(np.float32)
            else:
                values = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            writer.add_tensor(name, values)
            continue
        data, raw_dtype = random_tensor(rng, type_name, shape, std)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _llama3_rope_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for llama3 scaling: the divisor of each rotary frequency
    (1 for high frequencies, ``factor`` for low ones, a blend between), as its converter writes it."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_context_length"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    out = np.where(
        wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, 1.0 / ((1 - smooth) / factor + smooth))
    )
    return out.astype(np.float32)


def _copy_tokenizer(writer, src: str, vocab: int, pre: str | None = None) -> None:
    import gguf

    reader = gguf.GGUFReader(src)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.pre" and pre is not None:
            value = pre
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            extra = vocab - len(value)
            if extra < 0:
                raise ValueError(f"vocab {vocab} is smaller than {src}'s {len(value)} tokens")
            fill = {
                "tokenizer.ggml.tokens": [f"<extra_{i}>" for i in range(extra)],
                "tokenizer.ggml.token_type": [4] * extra,
                "tokenizer.ggml.scores": [0.0] * extra,
            }[key]
            value = list(value) + fill
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)


# -- Qwen2 from a transformers model, as llama.cpp's converter writes it -------------------------
# A ChatML template written for these tests (Qwen2's own format: <|im_start|>role\n...<|im_end|>\n)
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TINY_WORDS = (
    "Ġthe",
    "Ġand",
    "Ġhello",
    "Ġworld",
    "ing",
    "Ġis",
    "Ġa",
    "12",
    "123",
    "2024",
    "Ġ1",
    "00",
    "ĊĊ",
    "Ġcat",
    "Ġdog",
    "er",
    "Ġto",
)
_QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_qwen2_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small byte-level BPE in Qwen2's GGUF form: the 256 byte
    tokens in GPT-2's byte alphabet (transformers' table), merges that build a few words left to
    right (digit runs too, which only a split that keeps digits together could reach), then
    Qwen2's three control tokens. Its token types are llama.cpp's (1 normal, 3 control)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    merges: list[str] = []
    for word in _TINY_WORDS:
        left = word[0]
        for ch in word[1:]:
            merge = f"{left} {ch}"
            left += ch
            if merge not in merges:
                merges.append(merge)
                tokens.append(left) if left not in tokens else None
    types = [1] * len(tokens) + [3] * len(_QWEN2_SPECIALS)
    return tokens + list(_QWEN2_SPECIALS), types, merges


def write_hf_qwen2_gguf(
    path: str, model, *, type_name: str = "F32", chat_template: str | None = CHATML_TEMPLATE, eos: str = "<|im_end|>"
) -> str:
    """``model`` (a transformers ``Qwen2ForCausalLM`` whose vocabulary is :func:`tiny_qwen2_vocab`'s
    size) as llama.cpp's converter writes a Qwen2 GGUF: ``qwen2.*`` keys (no vocab_size, no key
    length), ``blk.N.*`` tensors in Hugging Face's row order, q/k/v biases, no ``output.weight`` when
    the head is tied; 2-D weights in ``type_name`` (``F32``, ``F16`` or a type the ``gguf``
    library quantizes), 1-D ones in F32; tokenizer keys with ``pre = "qwen2"``."""
    import gguf

    cfg = model.config
    tokens, types, merges = tiny_qwen2_vocab()
    if cfg.vocab_size != len(tokens):
        raise ValueError(f"the model's vocab_size {cfg.vocab_size} != the tiny vocabulary's {len(tokens)}")
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    roles = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(_FILE_TYPES.get(type_name, 1 if type_name == "F16" else 7))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index(eos))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    qtype = gguf.GGMLQuantizationType[type_name]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in names:
            out = names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            out = f"blk.{layer}.{roles[module]}.{kind}"
        values = tensor.detach().float().numpy()
        if values.ndim == 1 or type_name == "F32":
            writer.add_tensor(out, values)
        elif type_name == "F16":
            writer.add_tensor(out, values.astype(np.float16))
        else:
            writer.add_tensor(out, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
