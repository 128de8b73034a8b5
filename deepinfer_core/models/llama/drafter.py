"""The learned drafter for Llama-family targets: one decoder layer over the target's hidden state
and the next token's embedding (EAGLE / MTP style), sharing the target's embedding, final norm
and LM head, plus a confidence output (the probability that each draft is accepted).

One chain step, for a request whose newest committed token ``t`` sits at position ``p``::

    hidden [R, D]  (target pre-norm output at p-1, or the head's own output at the previous step)
    embed(t) [R, D]  (the target's embedding table)
      -> cat(hidden_norm(hidden), embed_norm(embed)) [R, 2D] -> fc -> x [R, D]
      -> decoder layer (attention over this call's chain steps so far, then SwiGLU MLP) -> out [R, D]
      -> target final norm -> draft-vocabulary rows of the target's LM head -> logits [R, Vd]
      -> draft = vocab_ids[argmax]; confidence = sigmoid(w . [norm(out), max prob, entropy, step])

γ > 1 chains by feeding ``out`` back as the next step's hidden (feature recurrence). The
attention spans only the steps of the current ``propose`` call (at most ``MAX_DRAFT_TOKENS``), so the
drafter keeps no per-request state: nothing to truncate or release when drafts are rejected.
The LM head is restricted to ``vocab_ids`` (the target's most frequent greedy tokens in the
training data), which makes a draft step several times cheaper than the full vocabulary.

Files: ``config.json`` (:class:`DraftHeadConfig`) and ``model.safetensors`` (the head's own
weights and ``vocab_ids``); nothing of the target is stored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...speculative import DraftBatch, DrafterContext
from ..layers import GatedMLP, RMSNorm, Rotary, rope_inv_freq

__all__ = [
    "DraftHead",
    "DraftHeadConfig",
    "LlamaDrafter",
    "SharedTarget",
    "build_draft_drafter",
    "load_head",
    "save_head",
    "shipped_head_dir",
]

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
MAX_DRAFT_TOKENS = 64  # the longest chain one propose call runs (the rotary table's length)
_SHIPPED = {"smollm2-135m-instruct": "smollm2-135m-instruct"}  # normalised target name -> package folder


@dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # rows of the target's LM head the head predicts over
    rms_norm_eps: float = 1e-5
    max_chain: int = 8  # step features of the confidence output (one-hot width)
    trained_chain: int = 0  # chain steps seen in training (0: max_chain); later steps reuse the last one's feature
    target: str = ""  # the model it was trained for (informational)
    format: str = "deepinfer-llama-draft-head-v1"

    @property
    def step_features(self) -> int:
        return min(self.trained_chain or self.max_chain, self.max_chain)

    @classmethod
    def for_target(
        cls, config: dict, draft_vocab_size: int, target: str = "", max_chain: int = 8, trained_chain: int = 0
    ) -> DraftHeadConfig:
        heads = int(config["num_attention_heads"])
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_chain=max_chain,
            trained_chain=trained_chain,
            target=target,
        )


class SharedTarget:
    """What the head borrows from the target: its embedding, its final norm and the draft
    vocabulary's rows of its LM head (copied once in the head's dtype; not stored with the head)."""

    def __init__(self, model, vocab_ids: torch.Tensor, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        inner = model.model
        self.norm = inner.norm
        ids = vocab_ids.to(next(model.parameters()).device)
        head = inner.embed_tokens if getattr(model, "lm_head", None) is None else model.lm_head
        with torch.no_grad():
            if isinstance(head, nn.Embedding) or head is inner.embed_tokens:
                rows = inner.embed_tokens(ids)  # tied: the embedding rows are the head rows
            elif isinstance(getattr(head, "weight", None), torch.Tensor) and head.weight.is_floating_point():
                rows = head.weight[ids]
            else:  # a packed head: project the identity through it, one block of rows at a time
                eye = torch.eye(model.config["hidden_size"], device=ids.device)
                rows = model.compute_logits(eye)[:, ids].T
        self.head_rows = rows.to(dtype).contiguous()  # [Vd, D]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, D]
        with torch.no_grad():
            return self.model.model.embed_tokens(ids).to(self.dtype)

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, Vd] float32
        normed = self.norm(out.to(self.norm.weight.dtype)).to(self.dtype)
        return F.linear(normed, self.head_rows).float()


class DraftHead(nn.Module):
    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden_norm, self.embed_norm = RMSNorm(D, eps), RMSNorm(D, eps)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.input_layernorm = RMSNorm(D, eps)
        self.q_proj = nn.Linear(D, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(D, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(D, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, D, bias=False)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.mlp = GatedMLP(D, cfg.intermediate_size)
        self.out_norm = RMSNorm(D, eps)
        self.confidence = nn.Linear(D + 2 + cfg.max_chain, 1)
        self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab_size, dtype=torch.long))
        self.rotary = Rotary(cfg.head_dim, MAX_DRAFT_TOKENS, rope_inv_freq(cfg.head_dim, 10000.0)[0])

    def step(
        self, hidden: torch.Tensor, token_embed: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:  # hidden, token_embed [N, D] -> out [N, D]; cache: this chain's (k, v), appended to
        c, N, k = self.cfg, hidden.shape[0], len(cache)
        x = self.fc(torch.cat([self.hidden_norm(hidden), self.embed_norm(token_embed)], dim=-1))  # [N, D]
        a = self.input_layernorm(x)
        at = self.rotary.at(torch.full((N,), k, dtype=torch.long, device=x.device), x.dtype)
        q = at(self.q_proj(a).view(N, c.num_heads, c.head_dim))  # [N, H, hd]
        kk = at(self.k_proj(a).view(N, c.num_kv_heads, c.head_dim))  # [N, Hkv, hd]
        cache.append((kk, self.v_proj(a).view(N, c.num_kv_heads, c.head_dim)))
        keys = torch.stack([e[0] for e in cache], dim=2)  # [N, Hkv, k+1, hd]
        values = torch.stack([e[1] for e in cache], dim=2)
        rep = c.num_heads // c.num_kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)  # [N, H, k+1, hd]
        attn = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values)  # [N, H, 1, hd]
        x = x + self.o_proj(attn.reshape(N, c.num_heads * c.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))

    def confidence_of(self, out: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:  # -> [N] in (0, 1)
        """P(this step's draft is accepted | the earlier ones were); its inputs are detached so
        the confidence loss never moves the drafter itself."""
        logp = torch.log_softmax(logits.detach().float(), dim=-1)  # [N, Vd]
        top = logp.max(dim=-1).values.exp()
        entropy = -(logp.exp() * logp).sum(dim=-1)
        step_index = min(k, self.cfg.step_features - 1)  # steps past the trained chain look like its last
        step = F.one_hot(torch.full_like(top, step_index, dtype=torch.long), self.cfg.max_chain).to(out.dtype)
        feats = torch.cat(
            [self.out_norm(out.detach()), top[:, None].to(out.dtype), entropy[:, None].to(out.dtype), step], -1
        )
        return torch.sigmoid(self.confidence(feats).squeeze(-1).float())


class LlamaDrafter:
    """:class:`~deepinfer_core.speculative.Drafter` over a :class:`DraftHead` and its target."""

    name = "draft"
    needs_hidden = True
    needs_token_ids = False

    def __init__(self, head: DraftHead, target: SharedTarget) -> None:
        self.head, self.target = head, target
        self._graphed = None  # (num_tokens, replay) where the platform captured the chain

    def use_graphs(self, capture, max_rows: int, num_tokens: int) -> None:
        """Have the platform capture the whole chain of ``num_tokens`` steps for up to
        ``max_rows`` requests (``DecodeGraphs.capture_draft``); calls of other sizes stay eager."""
        if not 1 <= num_tokens <= MAX_DRAFT_TOKENS:
            return
        D, device = self.head.cfg.hidden_size, self.head.vocab_ids.device
        example = (
            torch.zeros(max_rows, D, dtype=self.target.dtype, device=device),
            torch.zeros(max_rows, dtype=torch.long, device=device),
        )

        def chain(hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.no_grad():
                return self._chain(hidden, tokens, num_tokens)

        replay = capture(chain, example)
        self._graphed = None if replay is None else (num_tokens, replay)

    @torch.no_grad()
    def propose(self, batch: DraftBatch, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.hidden is None:
            raise ValueError("the 'draft' drafter needs the target's hidden states (DraftBatch.hidden)")
        if not 1 <= num_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_speculative_tokens for this head is 1..{MAX_DRAFT_TOKENS}, got {num_tokens}")
        hidden, tokens = batch.hidden.to(self.target.dtype), batch.last_token_ids.long()
        if self._graphed is not None and self._graphed[0] == num_tokens:
            out = self._graphed[1](hidden, tokens)
            if out is not None:
                return out
        return self._chain(hidden, tokens, num_tokens)

    def _chain(self, hidden: torch.Tensor, tokens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's ``num_tokens`` steps: tensors only, no host round trip (capturable)."""
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        drafts, confs = [], []
        for k in range(num_tokens):
            out = self.head.step(hidden, self.target.embed(tokens), cache)
            logits = self.target.logits(out)  # [R, Vd]
            tokens = self.head.vocab_ids[logits.argmax(dim=-1)]
            drafts.append(tokens)
            confs.append(self.head.confidence_of(out, logits, k))
            hidden = out
        return torch.stack(drafts, 1), torch.stack(confs, 1).clamp(0.0, 1.0)  # [R, γ] int64, [R, γ] float32


# -- files -----------------------------------------------------------------------------------


def save_head(head: DraftHead, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """``config.json`` + ``model.safetensors`` (float weights in ``dtype``, ``vocab_ids`` int64)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {
        n: (t.to(dtype) if t.is_floating_point() else t).cpu().contiguous() for n, t in head.state_dict().items()
    }
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(dataclasses.asdict(head.cfg), f, indent=2)
        f.write("\n")


def load_head(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> DraftHead:
    from safetensors.torch import load_file

    cfg_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not (os.path.isfile(cfg_path) and os.path.isfile(weights_path)):
        raise ValueError(
            f"{path}: not a drafter head (needs {CONFIG_FILE} and {WEIGHTS_FILE}; see deepinfer train-drafter)"
        )
    with open(cfg_path) as f:
        raw = json.load(f)
    if raw.get("format") != DraftHeadConfig.format:
        raise ValueError(f"{cfg_path}: format {raw.get('format')!r} is not {DraftHeadConfig.format!r}")
    known = {f.name for f in dataclasses.fields(DraftHeadConfig)}
    cfg = DraftHeadConfig(**{k: v for k, v in raw.items() if k in known})
    head = DraftHead(cfg)
    state = load_file(weights_path)
    head.vocab_ids = torch.empty(state["vocab_ids"].shape, dtype=torch.long)
    head.load_state_dict(state, strict=True)
    return head.to(device=device, dtype=dtype).eval()


def shipped_head_dir(target: str) -> str | None:
    """The head shipped in this package for ``target`` (an alias or a model path), or None."""
    name = os.path.basename(str(target)).lower().replace("_", "-")
    for key, folder in _SHIPPED.items():
        if key in name:
            return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "drafters", folder)
    return None


def build_draft_drafter(config: dict, ctx: DrafterContext) -> LlamaDrafter:
    """The ``"draft"`` factory: the head in ``config["model"]`` (a directory), else the shipped
    head for the target; checked against the target's shape."""
    path = config.get("model") or shipped_head_dir(ctx.model_path)
    if not path:
        raise ValueError(
            f"speculative method 'draft' needs speculative_config['model'] (a head directory): no head ships for "
            f"{ctx.model_path!r}; train one with `deepinfer train-drafter --model {ctx.model_path} --out DIR`"
        )
    model_cfg = getattr(ctx.model, "config", {}) or {}
    if not hasattr(ctx.model, "model") or not hasattr(ctx.model.model, "embed_tokens"):
        raise ValueError("speculative method 'draft' drafts for Llama-family targets only")
    # the engine's suggestion (a CPU: bf16 where it has bf16 dot products: a 3-draft chain 9.0 ms
    # against 13.1 in float32 on an AVX512-BF16 VM, 74% of it the head's matmuls), else float32 on
    # a CPU and the target's dtype elsewhere
    dtype = ctx.draft_dtype or (torch.float32 if torch.device(ctx.device).type == "cpu" else ctx.dtype)
    head = load_head(path, ctx.device, dtype)
    want = (head.cfg.hidden_size, head.cfg.vocab_size)
    have = (int(model_cfg.get("hidden_size", -1)), int(model_cfg.get("vocab_size", -1)))
    if want != have:
        raise ValueError(f"drafter head {path} is for hidden/vocab {want}, the target has {have}")
    return LlamaDrafter(head, SharedTarget(ctx.model, head.vocab_ids, dtype))
