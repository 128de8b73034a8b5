"""DeepSeek-V4 released checkpoints: FP8 / MXFP4 dequantization and names against transformers'
own loader, and bad checkpoints refused from their headers before anything is built."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deepinfer_core.models import WeightsError
from deepinfer_core.models.deepseek_v4.weights import iter_weights, read_headers
from deepinfer_core.models.loaders.formats import open_model_files
from deepinfer_core.quant import dequant_fp4, dequant_fp8_block, quant_fp4, quant_fp8_block
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")


def hf_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """transformers' own dequantization of one (weight, scale) pair."""
    return fp8.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)


@pytest.mark.parametrize("scale_as", ["e8m0", "uint8", "float32"])
def test_fp8_block_dequant_matches_transformers(scale_as):
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 0.3
    q, s = quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    stored = {"e8m0": s, "uint8": s.view(torch.uint8), "float32": s.float()}[scale_as]
    torch.testing.assert_close(dequant_fp8_block(q, stored), hf_dequant(q, stored), rtol=0, atol=0)
    assert (dequant_fp8_block(q, stored) - w).abs().max() < 0.1 * w.abs().max()  # a real quantization


def test_fp8_partial_edge_tiles_follow_the_tile_grid():
    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(1))
    q, s = quant_fp8_block(w)
    assert s.shape == (2, 2)
    rows, cols = torch.arange(200)[:, None] // 128, torch.arange(130)[None, :] // 128
    expected = q.float() * s.float()[rows, cols]  # element (r, c) scaled by tile (r // 128, c // 128)
    torch.testing.assert_close(dequant_fp8_block(q, s), expected, rtol=0, atol=0)


def test_mxfp4_dequant_matches_transformers():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    q, s = quant_fp4(w)
    assert q.dtype == torch.int8 and q.shape == (64, 128) and s.shape == (64, 8)
    torch.testing.assert_close(dequant_fp4(q, s), hf_dequant(q, s), rtol=0, atol=0)


def test_mxfp4_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(3)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    values = grid[torch.randint(0, len(grid), (8, 64), generator=g)]
    values[:, ::32] = 6.0  # each group's max sets its scale exactly
    scales = torch.exp2(torch.randint(-4, 4, (8, 2), generator=g).float())
    w = values * scales.repeat_interleave(32, dim=1)
    q, s = quant_fp4(w)
    assert torch.equal(dequant_fp4(q, s), w)


@pytest.fixture(scope="module", params=["bf16", "fp8", "fp8-experts"])
def checkpoint(request, tmp_path_factory):
    """bf16; FP8 with MXFP4 experts (the release); FP8 experts too (``expert_dtype: fp8``)."""
    path = tmp_path_factory.mktemp(f"v4_{request.param}")
    weights, experts = {"bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp4"), "fp8-experts": ("fp8", "fp8")}[request.param]
    write_tiny_v4_checkpoint(path, weights=weights, experts=experts)
    return request.param, str(path)


def _ours_stacked(path: str) -> dict[str, torch.Tensor]:
    """Our stream, with per-expert tensors stacked the way transformers holds them."""
    paths = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    out, experts = {}, {}
    for name, tensor in iter_weights(paths):
        if ".mlp.experts." in name:
            prefix, _, rest = name.partition(".mlp.experts.")
            index, proj, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(proj, {})[int(index)] = tensor
        else:
            out[name] = tensor
    for prefix, projs in experts.items():
        stack = {p: torch.stack([t[e] for e in sorted(t)]) for p, t in projs.items()}
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{prefix}.mlp.experts.down_proj"] = stack["down_proj"]
    return out


def test_released_layout_loads_in_transformers_with_the_same_values(checkpoint):
    """transformers' from_pretrained (its renames, and for FP8 / MXFP4 its own dequantization)
    accepts every tensor we write and ends up with exactly the tensors our reader yields."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    fmt, path = checkpoint
    extra = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if fmt != "bf16" else {}
    model, info = DeepseekV4ForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32, **extra)
    assert not any(info.values()), info
    theirs = model.state_dict()
    ours = {n: t for n, t in _ours_stacked(path).items() if not n.startswith("mtp.")}
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].to(tensor.dtype), tensor), name


def test_transformers_saved_checkpoint_reads_the_same(tmp_path):
    """transformers' save_pretrained writes the released names back in its own spelling
    (``model.`` prefix, ``attn.norm``...); that checkpoint passes the check and reads the same."""
    from transformers import DeepseekV4ForCausalLM

    write_tiny_v4_checkpoint(tmp_path / "released", weights="bf16")
    model = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "released", dtype=torch.float32)
    tmp_path = tmp_path / "saved"
    model.save_pretrained(tmp_path)
    files = open_model_files(tmp_path)  # header check included
    ours = _ours_stacked(str(tmp_path))
    theirs = model.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[n].to(t.dtype), t) for n, t in theirs.items())
    assert files.config["num_hidden_layers"] == TINY_V4_CONFIG["num_hidden_layers"]


def test_v3_style_scale_names_read_the_same(tmp_path):
    """FP8 scales named ``weight_scale_inv`` in float32 (transformers' and DeepSeek-V3's
    convention), under ``model.``-prefixed names, read exactly as the released ``.scale`` ones."""
    from safetensors.torch import load_file, save_file

    write_tiny_v4_checkpoint(tmp_path / "released", weights="fp8", experts="fp8")
    (tmp_path / "v3style").mkdir()
    for f in sorted(os.listdir(tmp_path / "released")):
        if f.endswith(".safetensors"):
            renamed = {}
            for name, t in load_file(tmp_path / "released" / f).items():
                if name.endswith(".scale") and not name.startswith("hc_"):
                    name, t = name[: -len("scale")] + "weight_scale_inv", t.float()
                renamed["model." + name if name.startswith("layers.") else name] = t
            save_file(renamed, tmp_path / "v3style" / f)
    (tmp_path / "v3style" / "config.json").write_text((tmp_path / "released" / "config.json").read_text())
    open_model_files(tmp_path / "v3style")  # the header check accepts it
    assert set(_ours_stacked(str(tmp_path / "v3style"))) == set(want := _ours_stacked(str(tmp_path / "released")))
    got = _ours_stacked(str(tmp_path / "v3style"))
    assert all(torch.equal(got[n], t) for n, t in want.items())


def test_released_formats_and_dtypes(checkpoint):
    fmt, path = checkpoint
    paths = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    headers = {n: meta["dtype"] for n, (_, meta) in read_headers(paths).items()}
    assert headers["layers.0.ffn.gate.tid2eid"] == "I32" and headers["layers.1.attn.compressor.ape"] == "F32"
    assert headers["layers.1.attn.compressor.wkv.weight"] == "BF16" and headers["embed.weight"] == "BF16"
    if fmt != "bf16":
        expert = "I8" if fmt == "fp8" else "F8_E4M3"
        assert headers["layers.0.attn.wq_a.weight"] == "F8_E4M3" and headers["layers.0.attn.wq_a.scale"] == "F8_E8M0"
        assert (
            headers["layers.2.ffn.experts.3.w2.weight"] == expert
            and headers["layers.2.ffn.experts.3.w2.scale"] == "F8_E8M0"
        )
        assert headers["mtp.0.e_proj.weight"] == "F8_E4M3"
    else:
        assert not any(n.endswith(".scale") for n in headers)


# -- bad input: refused from the headers, naming the tensor or field ---------------------------------
def _rewrite(path: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(path, f))
            edit(tensors)
            save_file(tensors, os.path.join(path, f), metadata={"format": "pt"})


@pytest.fixture
def fresh(tmp_path):
    write_tiny_v4_checkpoint(tmp_path, weights="fp8")
    return str(tmp_path)


def refuse_tensor_reads(monkeypatch) -> None:
    """From here on, reading tensor data fails the test: errors must come from headers alone."""
    import safetensors
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("layers.1.attn.indexer.wq_b.weight", None),
            r"missing tensors: layers\.1\.attn\.indexer\.wq_b\.weight",
        ),
        (
            lambda t: (
                t.update({"layers.2.attn.kv_norm.weight": torch.ones(32, dtype=torch.bfloat16)})
                if "layers.2.attn.kv_norm.weight" in t
                else None
            ),
            r"mis-shaped tensors: layers\.2\.attn\.kv_norm\.weight: got BF16 \[32\], expected \[64\]",
        ),
        (
            lambda t: t.pop("layers.3.ffn.experts.5.w3.scale", None),
            r"without scales tensors: layers\.3\.ffn\.experts\.5\.w3\.weight: MXFP4 weight has no scale tensor "
            r"layers\.3\.ffn\.experts\.5\.w3\.scale",
        ),
        (
            lambda t: (
                t.update({"layers.0.attn.wo_b.scale": torch.ones(1, 1).to(torch.float8_e8m0fnu)})
                if "layers.0.attn.wo_b.scale" in t
                else None
            ),
            r"layers\.0\.attn\.wo_b\.scale: got \[1, 1\], expected \[2, 1\]",
        ),
        (
            lambda t: t.update({"layers.0.attn.extra.weight": torch.ones(2)}) if "embed.weight" in t else None,
            r"unexpected tensors: layers\.0\.attn\.extra\.weight",
        ),
    ],
    ids=["missing", "mis-shaped", "fp4-without-scales", "bad-scale-grid", "unexpected"],
)
def test_bad_checkpoint_is_refused_from_headers(fresh, monkeypatch, edit, message):
    _rewrite(fresh, edit)
    refuse_tensor_reads(monkeypatch)
    with pytest.raises(WeightsError, match=message):
        open_model_files(fresh)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"compress_ratios": [0, 4, 64, 4, 0]}, r"'compress_ratios': unknown layer kind.*compress_ratio=64"),
        (
            {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]},
            r"'layer_types': unknown layer kind.*full_attention",
        ),
        ({"o_groups": 3}, r"'o_groups' \(3\) must divide num_attention_heads \(4\)"),
        ({"hidden_size": 128}, r"mis-shaped tensors: .*embed\.weight: got BF16 \[512, 256\], expected \[512, 128\]"),
        ({"n_routed_experts": 6}, r"unexpected tensors: .*experts\.6\.w1\.weight"),
    ],
    ids=["unknown-ratio", "unknown-layer-type", "o-groups", "hidden-size", "expert-count"],
)
def test_bad_config_is_refused_before_loading(fresh, monkeypatch, change, message):
    with open(os.path.join(fresh, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(fresh, "config.json"), "w") as f:
        json.dump(config | change, f)
    refuse_tensor_reads(monkeypatch)
    with pytest.raises(ValueError, match=message):
        open_model_files(fresh)


def test_good_checkpoint_passes_the_header_check(fresh):
    files = open_model_files(fresh)
    assert files.config["num_hidden_layers"] == TINY_V4_CONFIG["num_hidden_layers"]


def test_engine_refuses_a_bad_checkpoint_before_building_the_model(fresh, monkeypatch):
    from deepinfer_core import LLM
    from deepinfer_core.engine import loading

    _rewrite(fresh, lambda t: t.pop("layers.0.ffn.gate.tid2eid", None))

    def build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(loading, "build_model", build)
    with pytest.raises(WeightsError, match=r"missing tensors: layers\.0\.ffn\.gate\.tid2eid"):
        LLM(fresh, device="cpu")


@pytest.mark.parametrize("stored", [torch.int32, torch.int64])
def test_hash_tables_are_held_as_int32_with_the_file_s_values(fresh, stored):
    """The hash layers' token -> experts tables (129K x 6 in V4) are held as int32 whether the file
    stores I32 (the release) or I64, and route by exactly the file's values."""
    from safetensors.torch import load_file

    from deepinfer_core import LLM

    name = "layers.0.ffn.gate.tid2eid"
    _rewrite(fresh, lambda t: t.update({name: t[name].to(stored)}) if name in t else None)
    files = [os.path.join(fresh, f) for f in sorted(os.listdir(fresh)) if f.endswith(".safetensors")]
    table = next(t[name] for t in map(load_file, files) if name in t)
    assert table.dtype == stored and int(table.max()) > 0
    llm = LLM(fresh, device="cpu", dtype="float32", kv_cache_blocks=8)
    held = llm.engine.model.model.layers[0].mlp.gate.tid2eid
    assert held.dtype == torch.int32 and torch.equal(held.long(), table.long())
