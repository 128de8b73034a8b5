"""DeepSeek-V4 config: the Hugging Face dict read once, validated, frozen.

transformers' ``DeepseekV4Config`` accepts two spellings for the per-layer schedules, and the
released checkpoints use the older one, so both are read here the same way it folds them:

* attention kind per layer: ``layer_types`` (names), else legacy ``compress_ratios`` (0 / 4 /
  128 per layer), else transformers' default (2 heavily compressed, then CSA / HCA alternating);
* compress rate per kind: ``compress_rates`` dict, ``compress_rate_csa`` / ``_hca`` overrides;
* MoE kind per layer: ``mlp_layer_types``, else the first ``num_hash_layers`` (default 3) hash;
* rope: ``rope_parameters`` either nested ``{"main", "compress"}`` or flat (the flat keys are
  the YaRN scaling of the compressed branches, whose theta is ``compress_rope_theta``).

Every problem raises :class:`ValueError` naming the field and the allowed values, before any
tensor is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...attention import AttentionKind

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_KINDS = {
    SLIDING: AttentionKind.SLIDING,
    CSA: AttentionKind.COMPRESSED_SPARSE,
    HCA: AttentionKind.HEAVILY_COMPRESSED,
}
_RATIO_TO_KIND = {0: SLIDING, 4: CSA, 128: HCA}
MLP_KINDS = ("hash_moe", "moe")
_DEFAULT_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class V4Config:
    """What the V4 modules read, with every per-layer schedule resolved."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    layer_kinds: tuple[str, ...]
    compress_ratios: tuple[int, ...]  # per layer; 0 for sliding layers
    mlp_kinds: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    scoring: str
    routed_scaling: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: dict
    compress_rope: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_mtp_layers: int
    # The MTP blocks' attention kinds / ratios: the schedule's entries past the main layers where
    # it lists them (the released ``compress_ratios`` does), else sliding window.
    mtp_layer_kinds: tuple[str, ...] = ()
    mtp_compress_ratios: tuple[int, ...] = ()


def _positive(config: dict, name: str, default=None) -> int:
    value = config.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"DeepSeek-V4 config field {name!r} must be a positive integer, got {value!r}")
    return value


def _layer_kinds(config: dict, n: int) -> tuple[str, ...]:
    kinds = config.get("layer_types")
    if kinds is None and config.get("compress_ratios") is not None:
        ratios = list(config["compress_ratios"])
        bad = [r for r in ratios if r not in _RATIO_TO_KIND]
        if bad:
            raise ValueError(
                f"DeepSeek-V4 config field 'compress_ratios' entries must be one of {sorted(_RATIO_TO_KIND)}; got {bad}"
            )
        kinds = [_RATIO_TO_KIND[r] for r in ratios]
    if kinds is None:
        kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    kinds = list(kinds)
    if len(kinds) < n:
        raise ValueError(
            f"DeepSeek-V4 config field 'layer_types' has {len(kinds)} entries but num_hidden_layers is {n}"
        )
    bad = [k for k in kinds[:n] if k not in LAYER_KINDS]
    if bad:
        raise ValueError(
            f"DeepSeek-V4 config field 'layer_types' entries must be one of {sorted(LAYER_KINDS)}; got {bad}"
        )
    return tuple(kinds[:n])


def _mlp_kinds(config: dict, n: int) -> tuple[str, ...]:
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        n_hash = config.get("num_hash_layers", 3)
        kinds = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    kinds = list(kinds)
    if len(kinds) < n:
        raise ValueError(
            f"DeepSeek-V4 config field 'mlp_layer_types' has {len(kinds)} entries but num_hidden_layers is {n}"
        )
    bad = [k for k in kinds[:n] if k not in MLP_KINDS]
    if bad:
        raise ValueError(
            f"DeepSeek-V4 config field 'mlp_layer_types' entries must be one of {list(MLP_KINDS)}; got {bad}"
        )
    return tuple(kinds[:n])


def _ropes(config: dict, rope_dim: int) -> tuple[dict, dict]:
    rp = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
        compress = {**flat, "rope_theta": config.get("compress_rope_theta", 160000.0)}
    for params in (main, compress):
        params.setdefault("rope_type", params.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin on this branch
        compress.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    for label, params in (("main", main), ("compress", compress)):
        if params["rope_type"] not in ("default", "yarn"):
            raise ValueError(
                f"DeepSeek-V4 rope_parameters[{label!r}].rope_type must be 'default' or 'yarn', got "
                f"{params['rope_type']!r}"
            )
    return main, compress


def parse_config(config: dict) -> V4Config:
    """Validate a Hugging Face ``DeepseekV4Config`` dict; raise ``ValueError`` naming the field."""
    n = _positive(config, "num_hidden_layers")
    head_dim = _positive(config, "head_dim")
    heads = _positive(config, "num_attention_heads")
    if config.get("num_key_value_heads", 1) != 1:
        raise ValueError(
            "DeepSeek-V4 config field 'num_key_value_heads' must be 1 (shared K=V head), got "
            f"{config['num_key_value_heads']!r}"
        )
    factor = config.get("partial_rotary_factor")
    if factor is not None:  # transformers: the factor wins over a legacy qk_rope_head_dim
        rope_dim = int(head_dim * factor)
    else:
        rope_dim = config.get("qk_rope_head_dim") or int(head_dim * 64 / 512)
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ValueError(
            f"DeepSeek-V4 rope width (head_dim * partial_rotary_factor = {rope_dim}) must be even and in "
            f"(0, head_dim={head_dim}]"
        )
    o_groups = _positive(config, "o_groups", 8)
    if heads % o_groups:
        raise ValueError(f"DeepSeek-V4 config field 'o_groups' ({o_groups}) must divide num_attention_heads ({heads})")
    kinds = _layer_kinds(config, n)
    rates = dict(_DEFAULT_RATES) | dict(config.get("compress_rates") or {})
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if config.get(legacy) is not None:
            rates[kind] = config[legacy]
    for kind in (CSA, HCA):
        if not isinstance(rates.get(kind), int) or rates[kind] < 1:
            raise ValueError(
                f"DeepSeek-V4 config field 'compress_rates'[{kind!r}] must be a positive integer, got "
                f"{rates.get(kind)!r}"
            )
    ratios = tuple(0 if k == SLIDING else rates[k] for k in kinds)
    experts = _positive(config, "n_routed_experts", 256)
    top_k = _positive(config, "num_experts_per_tok", 6)
    if top_k > experts:
        raise ValueError(
            f"DeepSeek-V4 config field 'num_experts_per_tok' ({top_k}) exceeds n_routed_experts ({experts})"
        )
    scoring = config.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise ValueError(
            f"DeepSeek-V4 config field 'scoring_func' must be one of sqrtsoftplus, softmax, sigmoid; got {scoring!r}"
        )
    main, compress = _ropes(config, rope_dim)
    n_mtp = config.get("num_nextn_predict_layers", 1) or 0
    if not isinstance(n_mtp, int) or isinstance(n_mtp, bool) or n_mtp < 0:
        raise ValueError(
            f"DeepSeek-V4 config field 'num_nextn_predict_layers' must be a non-negative integer, got {n_mtp!r}"
        )
    schedule = config.get("layer_types") or config.get("compress_ratios") or ()
    mtp_kinds = _layer_kinds(config, n + n_mtp)[n:] if len(schedule) >= n + n_mtp else (SLIDING,) * n_mtp
    return V4Config(
        vocab_size=_positive(config, "vocab_size"),
        hidden_size=_positive(config, "hidden_size"),
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=_positive(config, "q_lora_rank", 1024),
        o_groups=o_groups,
        o_lora_rank=_positive(config, "o_lora_rank", 1024),
        window=_positive(config, "sliding_window", 128),
        layer_kinds=kinds,
        compress_ratios=ratios,
        mlp_kinds=_mlp_kinds(config, n),
        index_n_heads=_positive(config, "index_n_heads", 64),
        index_head_dim=_positive(config, "index_head_dim", 128),
        index_topk=_positive(config, "index_topk", 512),
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=_positive(config, "moe_intermediate_size", 2048),
        scoring=scoring,
        routed_scaling=float(config.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(config.get("swiglu_limit", 10.0)),
        hc_mult=_positive(config, "hc_mult", 4),
        hc_sinkhorn_iters=_positive(config, "hc_sinkhorn_iters", 20),
        hc_eps=float(config.get("hc_eps", 1e-6)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        main_rope=main,
        compress_rope=compress,
        max_position_embeddings=_positive(config, "max_position_embeddings", 1048576),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        num_mtp_layers=n_mtp,
        mtp_layer_kinds=mtp_kinds,
        mtp_compress_ratios=tuple(0 if k == SLIDING else rates[k] for k in mtp_kinds),
    )
