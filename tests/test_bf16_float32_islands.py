"""Running bf16, the parameters transformers keeps in float32 (its ``_keep_in_fp32_modules_strict``:
DeepSeek-V4's hyper-connection weights, sinks, compressor position biases, router bias and norms;
DeepSeek-V3's router) stay float32 in the engine too: the set is read off transformers' own model
loaded in bf16, not written here."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.fail("transformers >= 5.24 (DeepseekV4) is required for the DeepSeek-V4 tests")

from deepinfer_core import LLM  # noqa: E402
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint  # noqa: E402


def float32_names(model) -> set[str]:
    return {
        n
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if t.dtype == torch.float32 and "rotary_emb" not in n
    }


def floating(model) -> dict[str, torch.dtype]:
    return {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_v4_bf16_keeps_transformers_float32_parameters(tmp_path):
    write_tiny_v4_checkpoint(tmp_path, weights="bf16", seed=4)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    hf32 = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    want = float32_names(hf)
    assert any(n.endswith("attn_hc.fn") for n in want) and any(n.endswith("sinks") for n in want)
    llm = LLM(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_blocks=4)
    ours = floating(llm.engine.model)
    main = {n: d for n, d in ours.items() if not n.startswith("mtp.")}
    assert {n for n, d in main.items() if d == torch.float32} == want
    assert {d for n, d in main.items() if n not in want} == {torch.bfloat16}
    # The MTP block follows the same rule as a main layer (and DeepSeek's float32 enorm / hnorm).
    mtp32 = {n for n, d in ours.items() if n.startswith("mtp.0.") and d == torch.float32}
    as_layer = {
        "mtp.0." + n.split(".", 3)[3]
        for n in want
        if n.startswith(f"model.layers.{TINY_V4_CONFIG['num_hidden_layers'] - 1}.")
    }
    assert as_layer - {n for n in as_layer if "compressor" in n} <= mtp32
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.norm.weight", "mtp.0.hc_head.hc_fn"} <= mtp32
    # bf16 logits stay as close to the float32 reference as transformers' own bf16 run is.
    p = list(range(2, 12))
    with torch.no_grad():
        exact = hf32(torch.tensor([p])).logits[0].float()
        theirs = hf(torch.tensor([p])).logits[0].float()
    ours_err = (llm.engine.prompt_logits(p) - exact).abs().max().item()
    assert ours_err <= 2 * (theirs - exact).abs().max().item() + 1e-2


def test_v3_bf16_keeps_the_router_float32(tmp_path):
    from test_deepseek_v3 import tiny_hf_model

    tiny_hf_model().save_pretrained(tmp_path)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = float32_names(hf)
    assert any(n.endswith("mlp.gate.weight") for n in want)
    ours = floating(LLM(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_blocks=4).engine.model)
    assert {n for n, d in ours.items() if d == torch.float32} == want
