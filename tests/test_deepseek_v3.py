"""DeepSeek-V3 against transformers' own DeepseekV3ForCausalLM on tiny random checkpoints.

The reference is transformers (independent of us): its logits for every prompt position, and
its ``generate(do_sample=False)`` tokens. Our side goes through the whole public path:
``save_pretrained`` directory -> ``open_hf_dir`` -> ``build`` -> ``load_weights`` -> flat
batches over a paged KV cache built by hand.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from deepinfer_core.attention import AttentionMetadata  # noqa: E402
from deepinfer_core.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from deepinfer_core.models import CausalLM, ModelContext, WeightsError  # noqa: E402
from deepinfer_core.models.deepseek_v3.model import build  # noqa: E402
from deepinfer_core.models.loaders.hf import open_hf_dir  # noqa: E402
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher  # noqa: E402

BLOCK = 128
PROMPT_LENS = [1, 3, 7, 16, 29, 64, 100, 140]
NEW_TOKENS = 64
BLOCKS_PER_REQ = 2  # 140 + 64 tokens fit in two 128-token blocks
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    routed_scaling_factor=2.5, max_position_embeddings=256, initializer_range=0.1,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
VARIANTS = {
    "q_lora": {},
    "direct_q": {"q_lora_rank": None},
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        }  # fmt: skip
    },
}


def tiny_hf_model(**overrides):
    cfg = transformers.DeepseekV3Config(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper, biased routers so tokens pick different experts
        for i, layer in enumerate(model.model.layers[cfg.first_k_dense_replace :]):
            layer.mlp.gate.weight.mul_(8.0)
            # The last MoE layer's bias is mostly negative, as in trained DeepSeek checkpoints'
            # balancing biases, so selection scores below zero are exercised.
            shift = -0.7 if i == cfg.num_hidden_layers - cfg.first_k_dense_replace - 1 else 0.0
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.2 + shift)
    return model


def cpu_context() -> ModelContext:
    return ModelContext(
        device=torch.device("cpu"),
        dtype=torch.float32,
        attention_backend=lambda spec: TorchAttentionBackend(),
        moe_dispatcher=lambda spec: TorchMoEDispatcher(),
    )


def load_ours(path):
    files = open_hf_dir(path)
    model = build(files.config, cpu_context())
    model.load_weights(files.weights())
    return model


def new_caches(model, num_blocks: int = len(PROMPT_LENS) * BLOCKS_PER_REQ + 1):
    backend = TorchAttentionBackend()
    return [torch.zeros(backend.kv_cache_shape(s, num_blocks, BLOCK), dtype=s.kv_dtype) for s in model.attention_specs]


def block_table(req: int) -> list[int]:
    # Non-contiguous, descending block ids (block 0 unused), so a paging bug cannot hide.
    return [len(PROMPT_LENS) * BLOCKS_PER_REQ - BLOCKS_PER_REQ * req - j for j in range(BLOCKS_PER_REQ)]


def make_meta(reqs: list[int], done: list[int], new: list[int], batch_invariant=False) -> AttentionMetadata:
    """Flat-batch metadata: request ``reqs[i]`` has ``done[i]`` tokens cached, ``new[i]`` arrive."""
    positions = torch.cat([torch.arange(d, d + n) for d, n in zip(done, new)])
    slots = []
    for r, d, n in zip(reqs, done, new):
        table = block_table(r)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(d, d + n)]
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(new).cumsum(0)
    seq_lens = [d + n for d, n in zip(done, new)]
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        positions=positions,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor([block_table(r) for r in reqs], dtype=torch.int32),
        block_size=BLOCK,
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
        batch_invariant=batch_invariant,
    )


def step(model, caches, tokens: list[torch.Tensor], reqs, done, batch_invariant=False) -> torch.Tensor:
    """Run one flat batch; return float32 logits for every new token [T, V]."""
    meta = make_meta(reqs, done, [len(t) for t in tokens], batch_invariant)
    with torch.no_grad():
        hidden = model(torch.cat(tokens), meta.positions, caches, meta)
        return model.compute_logits(hidden)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory, prompts):
    """(transformers model, our model, transformers' logits per prompt) for one variant."""
    hf = tiny_hf_model(**VARIANTS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = load_ours(path)
    with torch.no_grad():
        ref = [hf(p[None]).logits[0] for p in prompts]
    return hf, ours, ref


def test_model_satisfies_protocol(pair):
    _, ours, _ = pair
    assert isinstance(ours, CausalLM)
    assert len(ours.attention_specs) == TINY["num_hidden_layers"]
    assert ours.attention_specs[0].head_dim == TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_flat_batch_logits_match_transformers(pair, prompts, batch_invariant):
    hf, ours, ref = pair
    caches = new_caches(ours)
    reqs = list(range(len(prompts)))
    logits = step(ours, caches, prompts, reqs, [0] * len(prompts), batch_invariant)
    got = torch.split(logits, PROMPT_LENS)
    for n, g, r in zip(PROMPT_LENS, got, ref):
        assert (g - r).abs().max().item() < 1e-4, f"prompt of {n} tokens"
    # The routers must actually spread tokens, or MoE bugs would hide behind one expert.
    for layer in ours.model.layers[TINY["first_k_dense_replace"] :]:
        load = layer.mlp.dispatcher.expert_load()
        assert (load > 0).sum().item() >= 6, load


def test_chunked_then_one_token_steps_match_full_logits(pair, prompts):
    _, ours, ref = pair
    caches = new_caches(ours)
    reqs = list(range(len(prompts)))
    firsts = [(n + 1) // 2 for n in PROMPT_LENS]  # prefill half of each prompt in one batch
    logits = torch.split(step(ours, caches, [p[:k] for p, k in zip(prompts, firsts)], reqs, [0] * len(reqs)), firsts)
    got = [[lg] for lg in logits]
    done = list(firsts)
    while True:  # then one token per request per step, requests dropping out as they finish
        active = [r for r in reqs if done[r] < PROMPT_LENS[r]]
        if not active:
            break
        out = step(ours, caches, [prompts[r][done[r] : done[r] + 1] for r in active], active, [done[r] for r in active])
        for i, r in enumerate(active):
            got[r].append(out[i : i + 1])
            done[r] += 1
    for r in reqs:
        assert (torch.cat(got[r]) - ref[r]).abs().max().item() < 1e-4, f"request {r}"


def test_greedy_generation_matches_transformers_generate(pair, prompts):
    hf, ours, _ = pair
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(p[None], max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones(1, len(p)))
            expected.append(out[0, len(p) :].tolist())
    caches = new_caches(ours)
    reqs = list(range(len(prompts)))
    logits = step(ours, caches, prompts, reqs, [0] * len(reqs))
    last = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    tokens = logits[last].argmax(-1)  # [R]
    generated = [[t] for t in tokens.tolist()]
    done = list(PROMPT_LENS)
    for _ in range(NEW_TOKENS - 1):  # every request decodes in the same flat batch
        tokens = step(ours, caches, list(tokens[:, None]), reqs, done).argmax(-1)
        for r, t in enumerate(tokens.tolist()):
            generated[r].append(t)
        done = [d + 1 for d in done]
    assert generated == expected


# -- loading ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = tiny_hf_model()
    path = tmp_path_factory.mktemp("single")
    hf.save_pretrained(path)
    return hf, path


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return step(model, new_caches(model), [ids], [0], [0])


class SharedFoldingDispatcher(TorchMoEDispatcher):
    """Offers ``forward_with_shared`` as cuda_sm100's GEMV path does: the shared expert arrives
    as a one-expert stack (``DeepseekV3MoE.shared_weights``) and is computed here from those
    views with plain torch (gate rows, then up rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared_seen: list = []

    def forward_with_shared(self, spec, x, ids, weights, experts, shared):
        self.shared_seen.append(shared)
        gate, up = torch.nn.functional.linear(x, shared.gate_up[0]).chunk(2, dim=-1)
        return self.forward(spec, x, ids, weights, experts) + torch.nn.functional.linear(
            torch.nn.functional.silu(gate) * up, shared.down[0]
        )


def test_shared_expert_views_are_derived_once_after_loading(saved, monkeypatch):
    """A dispatcher offering forward_with_shared gets the shared expert's views derived once
    after the weights load (not rebuilt per forward), and they read the loaded weights: the
    logits equal transformers'."""
    from deepinfer_core.models.deepseek_v3 import model as deepseek_v3

    hf, path = saved
    calls = []
    derive = deepseek_v3.DeepseekV3MoE.shared_weights
    monkeypatch.setattr(deepseek_v3.DeepseekV3MoE, "shared_weights", lambda self: calls.append(1) or derive(self))
    files = open_hf_dir(path)
    ctx = cpu_context()
    ours = build(
        files.config, ModelContext(ctx.device, ctx.dtype, ctx.attention_backend, lambda spec: SharedFoldingDispatcher())
    )
    ours.load_weights(files.weights())
    moe = [layer.mlp for layer in ours.model.layers[TINY["first_k_dense_replace"] :]]
    derived = len(calls)
    ids = torch.arange(5, 40)
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    for _ in range(3):
        assert (reference_logits(ours, ids) - want).abs().max().item() < 1e-4
    assert len(calls) == derived  # no forward derived them again
    for layer in moe:
        seen = layer.dispatcher.shared_seen
        assert len(seen) == 3 and all(s is seen[0] for s in seen)
        assert seen[0].gate_up.data_ptr() == layer.shared_experts.gate_up_proj.weight.data_ptr()


def test_sharded_checkpoint_loads_the_same_model(saved, tmp_path):
    hf, single = saved
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    a, b = open_hf_dir(single), open_hf_dir(tmp_path)
    assert len({v for v in json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].values()}) > 1
    assert sorted(n for n, _ in a.weights()) == sorted(n for n, _ in b.weights())
    assert b.fingerprint == open_hf_dir(tmp_path).fingerprint and len(b.fingerprint) == 64
    assert a.fingerprint != b.fingerprint  # different files on disk
    assert a.tokenizer is None  # save_pretrained of a bare model writes no tokenizer
    ids = torch.arange(5, 40)
    assert torch.equal(reference_logits(load_ours(single), ids), reference_logits(load_ours(tmp_path), ids))


def rewrite_checkpoint(src, dst, edit) -> None:
    """Copy ``src`` to ``dst`` with its tensors passed through ``edit(dict) -> dict``."""
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(edit(tensors), str(dst / "model.safetensors"))


def test_fused_expert_layout_loads(saved, tmp_path):
    hf, single = saved

    def fuse(t: dict) -> dict:
        for layer in range(TINY["first_k_dense_replace"], TINY["num_hidden_layers"]):
            pre = f"model.layers.{layer}.mlp.experts"
            E = TINY["n_routed_experts"]
            gate = [t.pop(f"{pre}.{e}.gate_proj.weight") for e in range(E)]
            up = [t.pop(f"{pre}.{e}.up_proj.weight") for e in range(E)]
            t[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
            t[f"{pre}.down_proj"] = torch.stack([t.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
        return t

    rewrite_checkpoint(single, tmp_path, fuse)
    ids = torch.arange(7, 30)
    assert torch.equal(reference_logits(load_ours(single), ids), reference_logits(load_ours(tmp_path), ids))


def test_bad_checkpoint_names_every_problem(saved, tmp_path):
    _, single = saved

    def damage(t: dict) -> dict:
        del t["model.layers.3.mlp.experts.5.up_proj.weight"]
        del t["model.layers.0.self_attn.kv_b_proj.weight"]
        t["model.layers.1.mlp.bogus.weight"] = torch.zeros(3)
        t["model.norm.weight"] = torch.ones(65)
        return t

    rewrite_checkpoint(single, tmp_path, damage)
    files = open_hf_dir(tmp_path)
    model = build(files.config, cpu_context())
    with pytest.raises(WeightsError) as err:
        model.load_weights(files.weights())
    msg = str(err.value)
    for name in (
        "model.layers.3.mlp.experts.5.up_proj.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.bogus.weight",
        "model.norm.weight",
    ):
        assert name in msg
    assert "model.layers.3.mlp.experts.gate_up_proj" not in msg  # named per expert, not stacked


def test_directory_errors_are_clear(saved, tmp_path):
    _, single = saved
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_hf_dir(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        open_hf_dir(tmp_path)
    shutil.copy(single / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        open_hf_dir(tmp_path)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        open_hf_dir(tmp_path)


def test_real_v3_rope_config_matches_transformers():
    """DeepSeek-V3's released config spells rope as legacy ``rope_scaling`` (YaRN, factor 40);
    our tables and softmax scale must equal transformers' for it, not just for tiny configs."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

    from deepinfer_core.models.deepseek_v3.mla import build_rotary, softmax_scale

    legacy = {
        "type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 4096,
    }  # fmt: skip
    ours = {"rope_scaling": legacy, "rope_theta": 10000, "max_position_embeddings": 4096,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}  # fmt: skip
    cfg = transformers.DeepseekV3Config(
        rope_scaling=dict(legacy), rope_theta=10000, max_position_embeddings=4096, qk_rope_head_dim=64
    )
    ref = hf_v3.DeepseekV3RotaryEmbedding(cfg)
    positions = torch.tensor([[0, 1, 17, 1000, 4095]])
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), positions)
    table = build_rotary(ours, torch.device("cpu"))
    assert torch.equal(table.cos[positions[0]], cos[0]) and torch.equal(table.sin[positions[0]], sin[0])
    assert softmax_scale(ours) == pytest.approx(hf_v3.yarn_apply_mscale(cfg.rope_parameters, 192**-0.5), rel=1e-12)
