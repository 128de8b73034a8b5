"""DeepSeek-V3's multi-token-prediction layer (issue 25, drafter (a) for V3 checkpoints).

transformers has no MTP module, so the reference is written here from the published equations
over transformers' own ``DeepseekV3DecoderLayer`` (the block the MTP layer is) and the saved
tensors; the engine's path (checkpoint names ``model.layers.{n}.*`` -> ``mtp.0.*``, its paged
cache, the shared embedding and head) is checked against it, and speculative decoding with it
against decoding without it.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.attention import AttentionMetadata
from deepinfer_core.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory):
    from deepinfer_core.testing.v3_checkpoint import TINY_V3_CONFIG, add_mtp_layers, tiny_deepseek_v3

    path = tmp_path_factory.mktemp("v3-mtp")
    hf = tiny_deepseek_v3(path, seed=2, router_gain=4.0, **TINY_V3_CONFIG)
    hf.config._attn_implementation = "eager"
    [mods] = add_mtp_layers(path, hf, seed=5)
    return str(path), hf, mods


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def _reference_mtp_logits(hf, mods, ids: list[int]) -> torch.Tensor:
    """MTP logits for positions 0 .. len(ids) - 2 (each predicting the token two ahead)."""
    eps = hf.config.rms_norm_eps
    seen = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, a, out: seen.setdefault("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        hf(torch.tensor([ids]))
    finally:
        hook.remove()
    h = seen["h"][0, :-1]  # pre-norm hidden at p
    emb = hf.model.embed_tokens(torch.tensor(ids[1:]))  # token at p + 1
    x = torch.cat([_rms(emb, mods["enorm"], eps), _rms(h, mods["hnorm"], eps)], -1) @ mods["eh_proj"].T
    T = x.shape[0]
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    cos_sin = hf.model.rotary_emb(x[None], pos)
    out = mods["layer"](x[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    out = out[0] if isinstance(out, tuple) else out
    return hf.lm_head(_rms(out[0], mods["head_norm"], eps)).float()


def _one_request(n: int, block_size: int) -> AttentionMetadata:
    """A prefill of ``n`` tokens of one request into block 0."""
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        positions=torch.arange(n), slot_mapping=torch.arange(n), block_tables=torch.tensor([[0]], dtype=torch.int32),
        block_size=block_size, max_query_len=n, max_seq_len=n,
    )  # fmt: skip


def test_mtp_layer_loads_and_matches_the_reference(v3_mtp):
    path, hf, mods = v3_mtp
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=8)
    model = llm.engine.model
    assert model.mtp is not None and len(model.mtp) == 1 and model.mtp_unavailable is None
    ids = [3 + (i * 7) % 120 for i in range(40)]
    want = _reference_mtp_logits(hf, mods, ids)
    # the engine's pieces: the main model's pre-norm hidden, then the MTP layer over its own cache
    T, bs = len(ids) - 1, 64
    caches = model.mtp_kv_layout(bs).allocate(1, 1, "cpu")
    main_caches = llm.engine.runner.kv_caches
    meta_main = _one_request(T + 1, llm.engine.config.block_size)
    with torch.inference_mode():
        _, pre = model.forward_hidden(torch.tensor(ids), meta_main.positions, main_caches, meta_main)
        meta = _one_request(T, bs)
        got, out = model.mtp_forward(pre[:-1], torch.tensor(ids[1:]), meta.positions, caches[0], meta)
    assert got.shape == want.shape and out.shape == (T, hf.config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_mtp_drafting_gives_the_tokens_of_decoding(v3_mtp):
    path, _, _ = v3_mtp
    prompts = [[4, 5, 6, 7] * 8, [3 + (i * 11) % 120 for i in range(70)]]
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0, max_tokens=24)]
    base = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=8)
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=8,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})  # fmt: skip
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.metrics["spec_num_draft_tokens"] > 0 for o in outs)


def test_a_v3_checkpoint_without_mtp_tensors_loads_and_says_why_it_cannot_draft(tmp_path):
    import json

    from deepinfer_core.testing.v3_checkpoint import TINY_V3_CONFIG, tiny_deepseek_v3

    tiny_deepseek_v3(tmp_path, seed=2, **TINY_V3_CONFIG)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1  # the config says so, the file has none (a trimmed release)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8)
    assert llm.engine.model.mtp is None and "no MTP layer tensors" in llm.engine.model.mtp_unavailable
    with pytest.raises(ValueError, match="no MTP layer tensors"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
