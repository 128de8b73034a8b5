"""DeepSeek-V4 multi-token prediction (MTP) blocks, usable as a drafter.

transformers has no MTP module (it skips the checkpoint's ``mtp.*`` tensors); the structure
follows DeepSeek's released inference code (``MTPBlock``). An MTP block is a full V4 decoder
block (attention of the kind the schedule gives position ``num_hidden_layers + k``, learned-routed
MoE, both hyper-connections) with its own input mixing and output head::

    x      = e_proj(enorm(embed(next_token)))[:, None, :] + h_proj(hnorm(streams))   [T, hc, D]
    x      = block(x)                                     (own KV: window ring + compressor state)
    logits = lm_head(norm(hc_head(x)))                    (embed and lm_head shared with the model)

``streams`` are the main model's last-layer hyper-connection streams, *before* its ``hc_head``
collapse and final norm (``hnorm`` normalises each stream separately); the block's output
streams feed the next MTP step when drafts are chained. Position ``p``'s MTP row combines the
hidden state at ``p`` with the token at ``p + 1`` and predicts the token at ``p + 2``; it is
roped at ``p`` (the position of its hidden state), as in DeepSeek's code.

The MTP block's cache is a separate :class:`~.deepseek_v4_kv.V4LayerCache` per block, laid out
by :meth:`DeepseekV4ForCausalLM.mtp_kv_layout`; the decoding loop that allocates and feeds it is
the speculative-decoding issue's.
"""

from __future__ import annotations

import dataclasses

from .config import V4Config


def with_mtp_layers(cfg: V4Config) -> V4Config:
    """``cfg`` with the MTP blocks appended as layers ``n .. n + num_mtp_layers - 1`` (their
    attention kinds from the schedule, learned-routed MoE), so the per-layer builders index them
    like main layers."""
    k = cfg.num_mtp_layers
    return dataclasses.replace(
        cfg,
        num_layers=cfg.num_layers + k,
        layer_kinds=cfg.layer_kinds + cfg.mtp_layer_kinds,
        compress_ratios=cfg.compress_ratios + cfg.mtp_compress_ratios,
        mlp_kinds=cfg.mlp_kinds + ("moe",) * k,
    )


NO_MTP_IN_CONFIG = "the config has num_nextn_predict_layers = 0"
NO_MTP_IN_CHECKPOINT = (
    "the checkpoint has no mtp.* tensors (a checkpoint without the MTP module loads, but cannot draft)"
)
