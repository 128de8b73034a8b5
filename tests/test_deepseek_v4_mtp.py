"""DeepSeek-V4 MTP drafter (``model.mtp_forward``) against an expected value built from
transformers' own V4 pieces.

transformers has no MTP module, so the expected value follows the structure of DeepSeek's
released inference code (``MTPBlock``): the checkpoint's ``mtp.0`` block is loaded *by
transformers* as the single decoder layer of a second ``DeepseekV4ForCausalLM`` (its ``hc_head``
and ``norm`` are the MTP block's, embed and head shared), and the few MTP-only ops (enorm, hnorm,
e_proj, h_proj, adding the embedding to every stream) are written here; a forward pre-hook puts
their result in place of that layer's input. The main model's last-layer streams come from a
hook on transformers' own last decoder layer.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.fail("transformers >= 5.24 (DeepseekV4) is required for the DeepSeek-V4 tests")

from safetensors.torch import save_file  # noqa: E402

from deepinfer_core import LLM  # noqa: E402
from deepinfer_core.attention import AttentionMetadata  # noqa: E402
from deepinfer_core.models import WeightsError  # noqa: E402
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, random_released_weights, write_tiny_v4_checkpoint  # noqa: E402

PROMPT_LEN = 150  # beyond the 16-token window, several CSA (4) and HCA (8) windows, two KV blocks
BLOCK = 128
MTP_BLOCK_PARTS = ("attn.", "ffn.", "attn_norm.", "ffn_norm.", "hc_attn_", "hc_ffn_")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def meta_for(n: int, start: int = 0, prompt: int = PROMPT_LEN) -> AttentionMetadata:
    """One request at state slot 0, blocks 0.. in order, new tokens ``start .. start + n`` of a
    ``prompt``-token sequence (the CSA indexer ranks its rows as a one-pass run does)."""
    end = start + n
    blocks = (end + BLOCK - 1) // BLOCK
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        positions=torch.arange(start, end),
        slot_mapping=torch.arange(start, end),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        block_size=BLOCK,
        max_query_len=n,
        max_seq_len=end,
        state_slots=torch.tensor([0]),
        prompt_lens=(prompt,),
    )


def mtp_reference_dir(src, dst, config: dict) -> None:
    """The checkpoint's MTP block as layer 0 of a one-layer model, in the released names, for
    transformers to load (and rename, and convert) itself."""
    from safetensors import safe_open

    with open(src / "model.safetensors.index.json") as f:
        files = set(json.load(f)["weight_map"].values())
    out = {}
    for file in files:
        with safe_open(src / file, framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if name in ("embed.weight", "head.weight"):
                    out[name] = t
                elif name.startswith("mtp.0."):
                    rest = name[len("mtp.0.") :]
                    if rest.startswith(MTP_BLOCK_PARTS):
                        out["layers.0." + rest] = t
                    elif rest.startswith("hc_head_") or rest == "norm.weight":
                        out[rest] = t
    dst.mkdir()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    n = config["num_hidden_layers"]
    one = dict(
        config,
        num_hidden_layers=1,
        num_hash_layers=0,
        num_nextn_predict_layers=0,
        compress_ratios=[config["compress_ratios"][n]],
    )
    with open(dst / "config.json", "w") as f:
        json.dump(one, f)


def dequant(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """An FP8 weight times its 128 x 128 tile scales (plain float weights unchanged)."""
    if scale is None:
        return weight.float()
    rows, cols = weight.shape
    s = scale.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return weight.float() * s


@pytest.fixture(
    scope="module", params=[("bf16", 0), ("bf16", 4), ("fp8", 0)], ids=["mtp-sliding", "mtp-csa", "mtp-fp8"]
)
def setup(request, tmp_path_factory):
    """(our model, transformers' main model, transformers' MTP-block model, MTP-only weights)."""
    from safetensors import safe_open

    weights, ratio = request.param
    config = dict(TINY_V4_CONFIG)
    config["compress_ratios"] = list(config["compress_ratios"][:-1]) + [ratio]
    root = tmp_path_factory.mktemp("v4mtp")
    config = write_tiny_v4_checkpoint(root / "ck", weights=weights, config=config, seed=11)
    mtp_reference_dir(root / "ck", root / "ref", config)
    kw = {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)} if weights == "fp8" else {}
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(root / "ck", dtype=torch.float32, **kw).eval()
    hf_mtp = transformers.DeepseekV4ForCausalLM.from_pretrained(root / "ref", dtype=torch.float32, **kw).eval()
    raw = {}
    for file in (root / "ck").glob("*.safetensors"):
        with safe_open(file, framework="pt") as fh:
            raw |= {
                name[len("mtp.0.") :]: fh.get_tensor(name)
                for name in fh.keys()
                if name.startswith("mtp.0.") and name.count(".") == 3
            }
    assert (weights == "fp8") == ("e_proj.scale" in raw)  # released FP8 e_proj / h_proj with tile scales
    extra = {
        f"{k}.weight": dequant(raw[f"{k}.weight"], raw.get(f"{k}.scale"))
        for k in ("e_proj", "h_proj", "enorm", "hnorm")
    }
    llm = LLM(str(root / "ck"), device="cpu", dtype="float32", kv_cache_blocks=4)
    return llm.engine.model, hf, hf_mtp, extra


def prompt(n=PROMPT_LEN, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, TINY_V4_CONFIG["vocab_size"], (n + 1,), generator=g)


def reference(hf, hf_mtp, extra, ids):
    """transformers: main-model streams at every position, then the MTP block's logits and
    output streams for (streams at p, token at p + 1)."""
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda m, a, out: captured.__setitem__("streams", out))
    with torch.no_grad():
        hf(ids[None, :-1])
    hook.remove()
    streams = captured["streams"][0]  # [T, hc, D]
    eps = TINY_V4_CONFIG["rms_norm_eps"]

    def rms(x, w):
        norm = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RMSNorm(x.shape[-1], eps)
        norm.weight.data = w
        return norm(x)

    nxt = ids[1:]
    with torch.no_grad():
        e = rms(hf.model.embed_tokens(nxt), extra["enorm.weight"])
        x = F.linear(e, extra["e_proj.weight"])[:, None, :] + F.linear(
            rms(streams, extra["hnorm.weight"]), extra["h_proj.weight"]
        )

        def swap_input(module, args, kwargs):
            return (x[None],) + args[1:], kwargs

        pre = hf_mtp.model.layers[0].register_forward_pre_hook(swap_input, with_kwargs=True)
        post = hf_mtp.model.layers[0].register_forward_hook(lambda m, a, out: captured.__setitem__("mtp", out))
        logits = hf_mtp(nxt[None]).logits[0]
        pre.remove()
        post.remove()
    return streams, logits, captured["mtp"][0]


def test_mtp_forward_matches_the_reference_built_from_transformers(setup):
    model, hf, hf_mtp, extra = setup
    ids = prompt()
    ref_streams, ref_logits, ref_out = reference(hf, hf_mtp, extra, ids)
    T = PROMPT_LEN
    meta = meta_for(T)
    caches = model.kv_layout(BLOCK).allocate(2, 1, "cpu")
    with torch.no_grad():
        streams = model.hidden_streams(ids[:-1], meta.positions, caches, meta)
    assert (streams - ref_streams).abs().max().item() < 1e-4
    (mtp_cache,) = model.mtp_kv_layout(BLOCK).allocate(2, 1, "cpu")
    with torch.no_grad():
        logits, out = model.mtp_forward(ref_streams, ids[1:], meta.positions, mtp_cache, meta)
    assert logits.shape == (T, TINY_V4_CONFIG["vocab_size"]) and logits.dtype == torch.float32
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert (out - ref_out).abs().max().item() < 1e-4
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))


def test_mtp_forward_in_chunks_and_one_token_steps_equals_one_pass(setup):
    # The MTP block keeps its own window / compressor state between calls, like a main layer.
    # The cut at 130 splits rows whose index scores tie exactly (relu zeros) at the top-k edge.
    model, hf, hf_mtp, extra = setup
    ids = prompt()
    ref_streams, ref_logits, _ = reference(hf, hf_mtp, extra, ids)
    (cache,) = model.mtp_kv_layout(BLOCK).allocate(2, 1, "cpu")
    got = []
    cuts = [0, 61, 130] + list(range(131, PROMPT_LEN + 1))
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:]):
            meta = meta_for(b - a, a)
            got.append(model.mtp_forward(ref_streams[a:b], ids[a + 1 : b + 1], meta.positions, cache, meta)[0])
    assert (torch.cat(got) - ref_logits).abs().max().item() < 1e-4


def write_without(path, drop) -> None:
    config = dict(TINY_V4_CONFIG)
    tensors = {k: v.contiguous() for k, v in random_released_weights(config, weights="bf16").items() if not drop(k)}
    path.mkdir()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with open(path / "config.json", "w") as f:
        json.dump(config, f)


def test_checkpoint_without_mtp_loads_and_drafting_says_why(tmp_path):
    write_without(tmp_path / "ck", lambda name: name.startswith("mtp."))
    llm = LLM(str(tmp_path / "ck"), device="cpu", dtype="float32", kv_cache_blocks=4)
    model = llm.engine.model
    assert model.mtp is None
    hc, d = TINY_V4_CONFIG["hc_mult"], TINY_V4_CONFIG["hidden_size"]
    with pytest.raises(RuntimeError, match="no mtp.* tensors"):
        model.mtp_forward(torch.zeros(1, hc, d), torch.tensor([3]), torch.tensor([0]), None, meta_for(1))
    assert llm.generate([[5, 6, 7]])[0].outputs[0].token_ids  # the main model still serves


def test_partial_mtp_module_is_an_error_naming_the_missing_tensor(tmp_path):
    write_without(tmp_path / "ck", lambda name: name == "mtp.0.e_proj.weight")
    with pytest.raises(WeightsError, match=r"missing tensors: mtp\.0\.e_proj\.weight"):
        LLM(str(tmp_path / "ck"), device="cpu", dtype="float32", kv_cache_blocks=4)


def test_mtp_forward_refuses_bad_shapes_and_block_numbers(setup):
    model = setup[0]
    hc, d = TINY_V4_CONFIG["hc_mult"], TINY_V4_CONFIG["hidden_size"]
    (cache,) = model.mtp_kv_layout(BLOCK).allocate(1, 1, "cpu")
    with pytest.raises(ValueError, match="hc_mult=4"):
        model.mtp_forward(torch.zeros(1, d), torch.tensor([3]), torch.tensor([0]), cache, meta_for(1))
    with pytest.raises(ValueError, match="MTP block 1 does not exist"):
        model.mtp_forward(torch.zeros(1, hc, d), torch.tensor([3]), torch.tensor([0]), cache, meta_for(1), block=1)
