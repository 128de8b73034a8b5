"""Write GGUF variants of a checkpoint for tests and benchmarks (the ``gguf`` library's own
quantizers, so the reference never comes from deepinfer's code).

``write_tiny_llama_gguf(path, {"general.sampling.temp": 0.5})`` writes a two-tensor llama GGUF
(no tokenizer) with extra float keys, for loader and cache tests.

``requantize_gguf(src, dst, "Q8_0")`` dequantizes every block-quantized tensor of ``src`` and
quantizes it again with ``gguf.quants.quantize``: the result is what llama.cpp's converter would
write from those float weights. Metadata is copied, ``general.file_type`` updated.
"""
from __future__ import annotations

import numpy as np

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
    for key, value in {"embedding_length": 64, "feed_forward_length": 128, "block_count": 1, "attention.head_count": 2}.items():
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
