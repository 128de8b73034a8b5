"""Llama 3.1+ GGUFs: llama.cpp's converter writes the llama3 rope scaling as a ``rope_freqs``
tensor (a divisor per rotary frequency), not as metadata. The loader refused such files
("unexpected: rope_freqs.weight"); now it reads the tensor into the rotary frequencies.

The reference is transformers: its own GGUF reader dequantizes and un-permutes the weights (it
ignores ``rope_freqs``), and the model is rebuilt with transformers' own llama3 rope parameters.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.testing.gguf_files import write_random_llama_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context_length": 64}


def _hf(folder, name: str, llama3: bool):
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(folder), gguf_file=name, torch_dtype=torch.float32)
    config = loaded.config
    if llama3:
        params = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": LLAMA3["factor"],
            "low_freq_factor": LLAMA3["low_freq_factor"],
            "high_freq_factor": LLAMA3["high_freq_factor"],
            "original_max_position_embeddings": LLAMA3["original_context_length"],
        }
        if hasattr(config, "rope_parameters"):
            config.rope_parameters = params
        else:  # transformers 4
            config.rope_scaling = params
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(loaded.state_dict())
    return model


@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_rope_freqs_tensor_gives_transformers_llama3_logits(tmp_path, type_name):
    path = write_random_llama_gguf(
        tmp_path / "l3.gguf",
        hidden=128,
        heads=2,
        kv_heads=1,
        head_dim=64,
        intermediate=256,
        layers=2,
        vocab=301,
        tied=False,
        types={"*": type_name},
        rope_theta=500000.0,
        rope_scaling=LLAMA3,
    )
    engine = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=4, enable_prefix_caching=False).engine
    ids = torch.randint(0, 301, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = engine.prompt_logits(ids)
    with torch.no_grad():
        want = _hf(tmp_path, "l3.gguf", llama3=True)(torch.tensor([ids])).logits[0]
        unscaled = _hf(tmp_path, "l3.gguf", llama3=False)(torch.tensor([ids])).logits[0]
    assert (unscaled - want).abs().max() > 0.1  # the scaling matters at these positions: the check can fail
    assert (ours - want).abs().max() < 1e-3
    # the CPU default (packed weights for Q8_0, the native plan) on the same file: the same greedy choices
    default = LLM(path, device="cpu", kv_cache_blocks=4, enable_prefix_caching=False).engine
    agree = (default.prompt_logits(ids).argmax(-1) == want.argmax(-1)).float().mean().item()
    unscaled_agree = (unscaled.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"{type_name} default: argmax agreement {agree:.3f} (unscaled rope: {unscaled_agree:.3f})")
    assert agree >= 0.9 > unscaled_agree


def test_rope_freqs_with_another_scaling_is_refused(tmp_path):
    import gguf

    path = str(tmp_path / "both.gguf")
    write_random_llama_gguf(
        path,
        hidden=64,
        heads=1,
        kv_heads=1,
        head_dim=64,
        intermediate=128,
        layers=1,
        vocab=40,
        tied=True,
        types={"*": "F32"},
        rope_scaling=LLAMA3,
    )
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "both2.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_string("llama.rope.scaling.type", "linear")
    writer.add_float32("llama.rope.scaling.factor", 2.0)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data.reshape(tuple(reversed([int(d) for d in t.shape]))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotImplementedError, match="rope_freqs.weight tensor together with rope scaling 'linear'"):
        LLM(str(tmp_path / "both2.gguf"), device="cpu", kv_cache_blocks=2)
