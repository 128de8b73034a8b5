"""Write GGUF variants of a checkpoint for tests and benchmarks (the ``gguf`` library's own
quantizers, so the reference never comes from deepinfer's code).

``requantize_gguf(src, dst, "Q8_0")`` dequantizes every block-quantized tensor of ``src`` and
quantizes it again with ``gguf.quants.quantize``: the result is what llama.cpp's converter would
write from those float weights. Metadata is copied, ``general.file_type`` updated.
"""
from __future__ import annotations

import numpy as np

_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "F32": 0}


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
