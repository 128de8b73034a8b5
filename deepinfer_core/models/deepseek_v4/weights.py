"""DeepSeek-V4 checkpoints as DeepSeek releases them: expected tensors, header checks, and
float tensors under transformers' names for the model.

The released safetensors use DeepSeek's own names (``layers.3.attn.wq_a.weight``,
``layers.3.ffn.experts.7.w1.weight``, ``hc_head_fn``...); transformers renames them when it loads
(its ``conversion_mapping`` for ``deepseek_v4``) and our model uses transformers' names. Formats
in the released files (see :mod:`deepinfer_core.quant`):

=======================================================  ========================================
tensors                                                  stored as
=======================================================  ========================================
``wq_a wq_b wkv wo_a wo_b``, ``indexer.wq_b``,           FP8 e4m3 + ``<name>.scale`` UE8M0 per
``shared_experts.w1/w2/w3``, MTP ``e_proj h_proj``       128 x 128 tile (BF16 in bf16 releases)
routed ``experts.E.w1/w2/w3``                            MXFP4 (int8 ``[out, in/2]``) +
                                                         ``.scale`` UE8M0 ``[out, in/32]``, or FP8
embed, head, norms, ``gate.weight``, compressor          BF16
``wkv/wgate``, ``indexer.weights_proj``
``hc_*``, ``attn_sink``, ``ape``, ``gate.bias``          F32
``gate.tid2eid`` (hash layers)                           int32 ``[vocab, top_k]``
=======================================================  ========================================

A transformers-saved checkpoint (names starting ``model.``) is passed through unchanged.
:func:`check_checkpoint` reads only the safetensors headers, so a missing or mis-shaped tensor,
or a quantized tensor without its scale, is reported (all of them, by name) before the model
allocates anything.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from ...quant import dequant_fp4, dequant_fp8_block, fp4_scale_shape, fp8_block_shape, scale_to_float
from .. import WeightsError

_RATIO_KIND = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
_FLOAT = {"BF16", "F16", "F32"}
_SHOWN = 20

_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# Released suffix inside a block -> transformers' suffix (longest prefixes first where they nest).
_BLOCK = (
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_", "attn_hc."),
    ("hc_ffn_", "ffn_hc."),
    ("attn.indexer.compressor.", "self_attn.compressor.indexer."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.compressor.", "self_attn.compressor."),
    ("attn.wq_a.", "self_attn.q_a_proj."),
    ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_b.", "self_attn.q_b_proj."),
    ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."),
    ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."),
    ("attn.attn_sink", "self_attn.sinks"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.", "mlp.shared_experts."),
    ("ffn.experts.", "mlp.experts."),
)
_COMPRESSOR_LEAF = {"wkv.": "kv_proj.", "wgate.": "gate_proj.", "norm.": "kv_norm.", "ape": "position_bias"}
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_PROJ = re.compile(r"^(mlp\.(?:shared_experts|experts\.\d+)\.)(w[123])(\..*)$")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the released layout. ``kind``: ``linear`` (BF16 or FP8 + tile scales),
    ``expert`` (BF16, FP8 or MXFP4 + scales), ``bf16`` / ``f32`` (plain float), ``int`` (table)."""

    shape: tuple[int, ...]
    kind: str
    optional: bool = False  # the MTP module: checked when present, never required


def hf_name(name: str) -> str:
    """transformers' name for a released tensor name (MTP keeps its ``mtp.N.`` prefix)."""
    if name in _TOP:
        return _TOP[name]
    head, sep, rest = name.partition(".")
    index, _, suffix = rest.partition(".")
    if head not in ("layers", "mtp") or not sep or not index.isdigit():
        return name
    prefix = f"model.layers.{index}." if head == "layers" else f"mtp.{index}."
    if head == "mtp" and suffix.startswith("hc_head_"):
        return prefix + "hc_head.hc_" + suffix[len("hc_head_") :]
    for old, new in _BLOCK:
        if suffix.startswith(old):
            suffix = new + suffix[len(old) :]
            break
    for marker in ("self_attn.compressor.indexer.", "self_attn.compressor."):
        if suffix.startswith(marker) and ".q_b_proj." not in suffix and ".scorer." not in suffix:
            leaf = suffix[len(marker) :]
            for old, new in _COMPRESSOR_LEAF.items():
                if leaf.startswith(old):
                    suffix = marker + new + leaf[len(old) :]
                    break
            break
    expert = _EXPERT_PROJ.match(suffix)
    if expert:
        suffix = expert.group(1) + _PROJ[expert.group(2)] + expert.group(3)
    return prefix + suffix


def _layer_kinds(config: dict, count: int) -> list[str]:
    kinds, field = config.get("layer_types"), "layer_types"
    if kinds is None and config.get("compress_ratios") is not None:
        field = "compress_ratios"
        kinds = [_RATIO_KIND.get(r, f"compress_ratio={r}") for r in config["compress_ratios"]]
    if kinds is None:
        kinds = ["heavily_compressed_attention"] * 2 + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(count)
        ]
    if len(kinds) < count:
        raise ValueError(f"DeepSeek-V4 config field {field!r} has {len(kinds)} entries, fewer than the {count} layers")
    bad = sorted({k for k in kinds[:count] if k not in _RATIO_KIND.values()})
    if bad:
        raise ValueError(
            f"DeepSeek-V4 config field {field!r}: unknown layer kind(s) {bad}; allowed: {list(_RATIO_KIND.values())} "
            "(compress_ratios 0, 4, 128)"
        )
    return list(kinds[:count])


def released_tensors(config: dict) -> dict[str, TensorSpec]:
    """Every tensor a released checkpoint for ``config`` holds, by released name."""
    g = config.get
    d, v, n = g("hidden_size", 4096), g("vocab_size", 129280), g("num_hidden_layers", 43)
    heads, hd = g("num_attention_heads", 64), g("head_dim", 512)
    q_rank, groups, o_rank = g("q_lora_rank", 1024), g("o_groups", 8), g("o_lora_rank", 1024)
    experts, top_k, inter = g("n_routed_experts", 256), g("num_experts_per_tok", 6), g("moe_intermediate_size", 2048)
    hc, ih, ihd = g("hc_mult", 4), g("index_n_heads", 64), g("index_head_dim", 128)
    rates = {
        "compressed_sparse_attention": g("compress_rate_csa", 4),
        "heavily_compressed_attention": g("compress_rate_hca", 128),
    }
    rates.update(g("compress_rates") or {})
    n_mtp = g("num_nextn_predict_layers", 1) or 0
    kinds = _layer_kinds(config, n)
    schedule = g("layer_types") or g("compress_ratios") or ()
    # MTP blocks take the schedule's entries past the main layers where it has them (the
    # released compress_ratios lists them), else a sliding-window block.
    kinds += _layer_kinds(config, n + n_mtp)[n:] if len(schedule) >= n + n_mtp else ["sliding_attention"] * n_mtp
    mlp_kinds = g("mlp_layer_types") or ["hash_moe"] * g("num_hash_layers", 3)
    hashed = {i for i, k in enumerate(mlp_kinds[:n]) if k == "hash_moe"}
    if heads % groups:
        raise ValueError(f"DeepSeek-V4 config field 'o_groups' ({groups}) must divide num_attention_heads ({heads})")
    specs: dict[str, TensorSpec] = {
        "embed.weight": TensorSpec((v, d), "bf16"),
        "head.weight": TensorSpec((v, d), "bf16"),
        "norm.weight": TensorSpec((d,), "bf16"),
        "hc_head_fn": TensorSpec((hc, hc * d), "f32"),
        "hc_head_base": TensorSpec((hc,), "f32"),
        "hc_head_scale": TensorSpec((1,), "f32"),
    }
    for i in range(n + n_mtp):
        mtp = i >= n
        p = f"mtp.{i - n}." if mtp else f"layers.{i}."
        block = {
            "attn_norm.weight": ((d,), "bf16"),
            "ffn_norm.weight": ((d,), "bf16"),
            "attn.wq_a.weight": ((q_rank, d), "linear"),
            "attn.q_norm.weight": ((q_rank,), "bf16"),
            "attn.wq_b.weight": ((heads * hd, q_rank), "linear"),
            "attn.wkv.weight": ((hd, d), "linear"),
            "attn.kv_norm.weight": ((hd,), "bf16"),
            "attn.wo_a.weight": ((groups * o_rank, heads * hd // groups), "linear"),
            "attn.wo_b.weight": ((d, groups * o_rank), "linear"),
            "attn.attn_sink": ((heads,), "f32"),
            "ffn.gate.weight": ((experts, d), "bf16"),
            "ffn.shared_experts.w1.weight": ((inter, d), "linear"),
            "ffn.shared_experts.w3.weight": ((inter, d), "linear"),
            "ffn.shared_experts.w2.weight": ((d, inter), "linear"),
        }
        for mix in ("attn", "ffn"):
            block |= {
                f"hc_{mix}_fn": (((2 + hc) * hc, hc * d), "f32"),
                f"hc_{mix}_base": (((2 + hc) * hc,), "f32"),
                f"hc_{mix}_scale": ((3,), "f32"),
            }
        if i in hashed:
            block["ffn.gate.tid2eid"] = ((v, top_k), "int")
        else:
            block["ffn.gate.bias"] = ((experts,), "f32")
        for e in range(experts):
            block |= {
                f"ffn.experts.{e}.w1.weight": ((inter, d), "expert"),
                f"ffn.experts.{e}.w3.weight": ((inter, d), "expert"),
                f"ffn.experts.{e}.w2.weight": ((d, inter), "expert"),
            }
        if kinds[i] != "sliding_attention":
            ratio = rates[kinds[i]]
            csa = kinds[i] == "compressed_sparse_attention"
            # CSA compressors (and the indexer's) overlap windows whatever their rate, as
            # transformers builds them (DeepSeek's release has CSA at rate 4 only).
            block |= _compressor("attn.compressor.", ratio, hd, d, overlap=csa)
            if csa:
                block |= _compressor("attn.indexer.compressor.", ratio, ihd, d, overlap=True)
                block |= {
                    "attn.indexer.wq_b.weight": ((ih * ihd, q_rank), "linear"),
                    "attn.indexer.weights_proj.weight": ((ih, d), "bf16"),
                }
        if mtp:
            block |= {
                "e_proj.weight": ((d, d), "linear"),
                "h_proj.weight": ((d, d), "linear"),
                "enorm.weight": ((d,), "bf16"),
                "hnorm.weight": ((d,), "bf16"),
                "norm.weight": ((d,), "bf16"),
                "hc_head_fn": ((hc, hc * d), "f32"),
                "hc_head_base": ((hc,), "f32"),
                "hc_head_scale": ((1,), "f32"),
            }
        specs |= {p + k: TensorSpec(shape, kind, optional=mtp) for k, (shape, kind) in block.items()}
    if config.get("tie_word_embeddings"):
        specs.pop("head.weight")
    return specs


def _compressor(prefix: str, ratio: int, width: int, d: int, overlap: bool) -> dict:
    c = 2 if overlap else 1
    return {
        prefix + "ape": ((ratio, c * width), "f32"),
        prefix + "wkv.weight": ((c * width, d), "bf16"),
        prefix + "wgate.weight": ((c * width, d), "bf16"),
        prefix + "norm.weight": ((width,), "bf16"),
    }


def read_headers(paths: list[str]) -> dict[str, tuple[str, dict]]:
    """``name -> (path, {"dtype", "shape", ...})`` from the safetensors headers only."""
    out: dict[str, tuple[str, dict]] = {}
    for path in paths:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        out |= {k: (path, meta) for k, meta in header.items() if k != "__metadata__"}
    return out


_RELEASED_BLOCK = re.compile(r"^(?:layers|mtp)\.\d+\.(?:attn\.|ffn\.|attn_norm\.|ffn_norm\.|hc_(?:attn|ffn)_)")


# transformers' save_pretrained writes the released names back with a few differences.
_SAVED_ALIASES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_SAVED_KV_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn\.)norm\.")


def released_name(name: str) -> str:
    """The released name of a tensor as transformers' ``save_pretrained`` writes it (``model.``
    prefix, ``attn.norm`` for ``attn.kv_norm``, ``weight_scale_inv`` for ``scale``...); other
    names unchanged."""
    if name in _SAVED_ALIASES:
        return _SAVED_ALIASES[name]
    rest = name[len("model.") :] if name.startswith("model.") else None
    if rest is not None and (rest in _TOP or _RELEASED_BLOCK.match(rest)):
        name = rest
    if name.endswith(".weight_scale_inv"):  # transformers' / DeepSeek-V3's name for the tile scales
        name = name[: -len("weight_scale_inv")] + "scale"
    return _SAVED_KV_NORM.sub(r"\1kv_norm.", name)


def is_released_layout(names) -> bool:
    """Whether a checkpoint uses DeepSeek's released names (else transformers' in-memory ones)."""
    return any(_RELEASED_BLOCK.match(released_name(n)) for n in names)


def renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """For a model's ``load_weights``: every name in transformers' spelling (the MTP module keeps
    its ``mtp.N.`` prefix). Already-renamed names pass unchanged. The tile scales of a weight kept
    FP8 (:func:`iter_weights` with ``keep``) arrive as ``X.weight_scale_inv``, the name the FP8
    modules' ``checkpoint_slots`` give them."""
    for name, tensor in weights:
        if name.endswith(".weight_scale_inv"):
            yield hf_name(released_name(name[: -len("_scale_inv")])) + "_scale_inv", tensor
        else:
            yield hf_name(released_name(name)), tensor


def fp8_weight_names(headers: dict[str, tuple[str, dict]]) -> frozenset[str]:
    """transformers' names (``X.weight``) of a released checkpoint's FP8 e4m3 weights that come
    with their UE8M0 tile scales: the weights a model may keep FP8 (``models.fp8.swap_in_fp8``),
    the MTP module's (``mtp.N.``) included."""
    return _scaled_weight_names(headers, ("F8_E4M3",))


def mxfp4_weight_names(headers: dict[str, tuple[str, dict]]) -> frozenset[str]:
    """transformers' names (``model.layers.L.mlp.experts.N.{gate,up,down}_proj.weight``, and
    ``mtp.N.mlp.experts...`` for the MTP module's) of a released checkpoint's MXFP4 routed-expert
    weights (int8 / uint8 packed e2m1 pairs with their UE8M0 ``.scale``): the weights a model may
    keep packed (``models.mxfp4.swap_in_mxfp4``)."""
    return _scaled_weight_names(headers, ("I8", "U8"), experts_only=True)


def _scaled_weight_names(
    headers: dict[str, tuple[str, dict]], dtypes: tuple[str, ...], experts_only: bool = False
) -> frozenset[str]:
    """transformers' names of a released checkpoint's ``X.weight`` tensors stored as one of
    ``dtypes`` with an ``X.scale`` beside them (routed experts only with ``experts_only``); empty
    for a checkpoint not in the released layout."""
    if not is_released_layout(headers):
        return frozenset()
    names = {released_name(n): meta for n, (_, meta) in headers.items()}
    return frozenset(
        hf_name(n)
        for n, meta in names.items()
        if meta["dtype"] in dtypes and n.endswith(".weight") and n[: -len("weight")] + "scale" in names
        and (not experts_only or ".experts." in n)
    )  # fmt: skip


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Stored MXFP4 scales as their UE8M0 exponent bytes (uint8 b: multiply by 2^(b - 127)):
    ``float8_e8m0fnu`` and byte tensors as they are, float32 powers of two by their exponent."""
    if scale.dtype in (torch.uint8, torch.int8) or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    return (torch.log2(scale.float()).round() + 127).clamp(0, 255).to(torch.uint8)


def check_checkpoint(config: dict, headers: dict[str, tuple[str, dict]]) -> None:
    """Raise :class:`WeightsError` naming every missing, unexpected or mis-shaped tensor and
    every quantized tensor without (or with a mis-shaped) scale; reads no tensor data."""
    if not is_released_layout(headers):
        return
    specs = released_tensors(config)
    headers = {released_name(n): v for n, v in headers.items()}
    problems: dict[str, list[str]] = {"missing": [], "unexpected": [], "mis-shaped": [], "without scales": []}
    scales = {n for n in headers if n.endswith(".scale") and n[: -len("scale")] + "weight" in headers}
    for name, (_, meta) in headers.items():
        if name in scales:
            continue
        spec = specs.get(name)
        if spec is None:
            problems["unexpected"].append(name)
            continue
        problem = _check_one(name, spec, meta, headers)
        if problem:
            problems[problem[0]].append(problem[1])
    problems["missing"] = [n for n, s in specs.items() if not s.optional and n not in headers]
    if any(problems.values()):
        parts = []
        for label, names in problems.items():
            if names:
                more = f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
                parts.append(f"{label} tensors: {', '.join(names[:_SHOWN])}{more}")
        raise WeightsError("DeepSeek-V4 checkpoint does not match its config: " + "; ".join(parts))


def _check_one(name: str, spec: TensorSpec, meta: dict, headers) -> tuple[str, str] | None:
    """``(category, message)`` for a tensor that does not fit its spec, else None."""
    dtype, shape = meta["dtype"], tuple(meta["shape"])
    scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
    scale = headers.get(scale_name, (None, None))[1] if scale_name else None
    if spec.kind == "int":
        ok = dtype in ("I32", "I64") and shape == spec.shape
        return None if ok else ("mis-shaped", f"{name}: got {dtype} {list(shape)}, expected I32/I64 {list(spec.shape)}")
    if dtype in _FLOAT and shape == spec.shape:
        return None
    quantized = spec.kind in ("linear", "expert") and dtype in ("F8_E4M3", "I8", "U8")
    if not quantized:
        return "mis-shaped", f"{name}: got {dtype} {list(shape)}, expected {list(spec.shape)}" + (
            " (BF16/F32)" if spec.kind in ("bf16", "f32") else ""
        )
    fp4 = dtype in ("I8", "U8")
    want = (*spec.shape[:-1], spec.shape[-1] // 2) if fp4 else spec.shape
    if shape != want:
        return (
            "mis-shaped",
            f"{name}: got {dtype} {list(shape)}, expected {list(want)} "
            f"({'MXFP4 packs two values per byte' if fp4 else 'FP8'})",
        )
    if scale is None:
        return "without scales", f"{name}: {'MXFP4' if fp4 else 'FP8'} weight has no scale tensor {scale_name}"
    want_scale = fp4_scale_shape(want) if fp4 else fp8_block_shape(want)
    if tuple(scale["shape"]) != want_scale:
        return "mis-shaped", f"{scale_name}: got {list(scale['shape'])}, expected {list(want_scale)}"
    return None


def iter_weights(
    paths: list[str], headers: dict[str, tuple[str, dict]] | None = None, keep: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(transformers name, tensor)`` one at a time: FP8 / MXFP4 weights dequantized with their
    scales, other floats as float32, integer tables unchanged. Scales are consumed, not yielded,
    except for the FP8 weights named in ``keep`` (transformers' names, from
    :func:`fp8_weight_names`): those pass as stored (float8 e4m3) followed by
    ``X.weight_scale_inv``, their UE8M0 tile scales as float32 multipliers (exact: powers of two).
    MXFP4 routed-expert weights named in ``keep`` (from :func:`mxfp4_weight_names`) pass packed
    as uint8 ``[out, in/2]`` followed by ``X.weight_scale_inv``, their UE8M0 exponents as uint8
    ``[out, in/32]`` (:func:`ue8m0_bytes`; ``models.mxfp4`` holds them so)."""
    from safetensors import safe_open

    headers = headers if headers is not None else read_headers(paths)
    released = is_released_layout(headers)
    canonical = {released_name(n) if released else n: n for n in headers}  # released name -> stored
    handles = {}
    try:
        for path in paths:
            handles[path] = safe_open(path, framework="pt")
        for stored, (path, meta) in headers.items():
            name = released_name(stored) if released else stored
            scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
            if released and name.endswith(".scale") and name[: -len("scale")] + "weight" in canonical:
                continue
            tensor = handles[path].get_tensor(stored)
            if released and scale_name in canonical and meta["dtype"] in ("F8_E4M3", "I8", "U8"):
                scale_stored = canonical[scale_name]
                scale = handles[headers[scale_stored][0]].get_tensor(scale_stored)
                if meta["dtype"] == "F8_E4M3" and hf_name(name) in keep:
                    yield hf_name(name), tensor
                    yield hf_name(name) + "_scale_inv", scale_to_float(scale)
                    continue
                if meta["dtype"] != "F8_E4M3" and hf_name(name) in keep:
                    yield hf_name(name), tensor.view(torch.uint8)
                    yield hf_name(name) + "_scale_inv", ue8m0_bytes(scale)
                    continue
                tensor = dequant_fp4(tensor, scale) if meta["dtype"] != "F8_E4M3" else dequant_fp8_block(tensor, scale)
            elif tensor.is_floating_point():
                tensor = tensor.float()
            yield (hf_name(name) if released else name), tensor
    finally:
        handles.clear()
