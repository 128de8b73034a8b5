"""Training and evaluating a :class:`~.drafter.DraftHead` by self-distillation (pure torch; the
``deepinfer train-drafter`` command generates the text and calls these).

Data: sequences the target wrote itself. One teacher-forced pass of the dense target over each
sequence gives, at every position ``i``, its pre-norm hidden ``H[i]`` and its greedy next token
``g[i]``. A training sample is a start position ``p`` and a chain of ``K`` steps: step ``k``
reads the hidden (``H[p-1]`` at step 0, the head's own output after) and the token ``x[p+k]``,
and must predict ``g[p+k]`` (cross-entropy over the draft vocabulary), with its output pulled
towards ``H[p+k]`` (feature regression, direction only). The confidence output learns by BCE
whether its step's argmax equalled ``g[p+k]``, on samples whose earlier steps were all right
(the confidence is conditional: P(draft k accepted | drafts < k accepted)).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .drafter import DraftHead, SharedTarget

__all__ = [
    "TeacherData",
    "expected_calibration_error",
    "prenorm_hidden",
    "teacher_data",
    "evaluate_head",
    "train_head",
    "top_tokens",
]


@torch.no_grad()
def prenorm_hidden(model, sequences: list[list[int]], batch_tokens: int = 4096) -> list[torch.Tensor]:
    """The target's last decoder layer output before the final norm, [L, D] float32 per sequence,
    from a dense Llama model's own modules (causal attention over the whole sequence, no cache);
    the same numbers its paged forward computes, a whole sequence per matmul."""
    out: list[torch.Tensor | None] = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    device = next(model.parameters()).device
    i = 0
    while i < len(order):
        j, longest = i, 0
        while j < len(order) and max(longest, len(sequences[order[j]])) * (j - i + 1) <= max(batch_tokens, longest):
            longest = max(longest, len(sequences[order[j]]))
            j += 1
        j = max(j, i + 1)
        group = [sequences[k] for k in order[i:j]]
        S = max(len(s) for s in group)
        ids = torch.zeros(len(group), S, dtype=torch.long, device=device)
        for r, s in enumerate(group):
            ids[r, : len(s)] = torch.tensor(s)
        hidden = _dense_forward(model, ids)  # [B, S, D]
        for r, k in enumerate(order[i:j]):
            out[k] = hidden[r, : len(sequences[k])].float()
        i = j
    return out  # type: ignore[return-value]


def _dense_forward(model, ids: torch.Tensor) -> torch.Tensor:  # [B, S] right-padded -> [B, S, D] pre-norm
    B, S = ids.shape
    h = model.model.embed_tokens(ids.flatten())  # [B*S, D]
    rotary = model.rotary.at(torch.arange(S, device=ids.device).repeat(B), h.dtype)
    for layer in model.model.layers:
        attn, s = layer.self_attn, layer.self_attn.spec
        a = layer.input_layernorm(h)
        q, k, v = attn.qkv_proj.split(attn.qkv_proj(a))
        q = rotary(q.reshape(B * S, s.num_heads, s.head_dim)).view(B, S, s.num_heads, s.head_dim).transpose(1, 2)
        k = rotary(k.reshape(B * S, s.num_kv_heads, s.head_dim)).view(B, S, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = v.reshape(B, S, s.num_kv_heads, s.head_dim).transpose(1, 2)
        rep = s.num_heads // s.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s.scale)  # [B, H, S, hd]
        h = h + attn.o_proj(o.transpose(1, 2).reshape(B * S, s.num_heads * s.head_dim))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h.view(B, S, -1)


@dataclass
class TeacherData:
    """Sequences flattened end to end: ``hidden[i]`` / ``greedy[i]`` belong to token ``tokens[i]``;
    ``starts`` are the chain start positions whose ``p-1 .. p+chain-1`` lie in one sequence and
    in its trainable region."""

    hidden: torch.Tensor  # [N, D] bfloat16
    tokens: torch.Tensor  # [N] int64
    greedy: torch.Tensor  # [N] int64, the target's argmax after tokens[i]
    starts: torch.Tensor  # [S] int64
    chain: int


def teacher_data(
    model,
    sequences: list[list[int]],
    regions: list[int],
    chain: int,
    log: Callable[[str], None] = print,
    engine=None,
) -> TeacherData:
    """``regions[s]``: the first position of sequence ``s`` worth drafting (after the system text).
    ``engine``: an :class:`~deepinfer_core.engine.llm_engine.LLMEngine` of the target whose own
    forward (``prompt_hidden``: its weights as it serves them, e.g. the CPU's packed low-bit
    ones) gives the hidden states and greedy tokens; None: ``model``'s dense forward."""
    hidden_parts, token_parts, greedy_parts, starts = [], [], [], []
    offset, t0 = 0, time.time()
    device = next(model.parameters()).device
    for b in range(0, len(sequences), 64):
        chunk = sequences[b : b + 64]
        for seq, region, (h, greedy) in zip(chunk, regions[b : b + 64], _teacher_pass(model, engine, chunk, device)):
            hidden_parts.append(h.to(torch.bfloat16))
            token_parts.append(torch.tensor(seq, device=device))
            greedy_parts.append(greedy)
            first = max(1, region)
            starts.extend(range(offset + first, offset + len(seq) - chain + 1))
            offset += len(seq)
        log(f"  teacher pass: {min(b + 64, len(sequences))}/{len(sequences)} sequences, {offset} tokens, "
            f"{time.time() - t0:.0f} s")  # fmt: skip
    return TeacherData(
        torch.cat(hidden_parts), torch.cat(token_parts), torch.cat(greedy_parts), torch.tensor(starts), chain
    )


def _teacher_pass(model, engine, chunk: list[list[int]], device: torch.device):
    """(pre-norm hidden [L, D], greedy next token [L]) per sequence of ``chunk``, on ``device``."""
    if engine is not None:
        for seq in chunk:
            with torch.no_grad():
                logits, pre = engine.prompt_hidden(seq)
            yield pre.detach().float().to(device), logits.argmax(-1).to(device)
        return
    for h in prenorm_hidden(model, chunk):
        with torch.no_grad():  # closed before the yield: the caller's code never runs with grad off by our doing
            greedy = model.compute_logits(model.model.norm(h)).argmax(-1)
        yield h, greedy


def top_tokens(data: TeacherData, size: int, vocab_size: int, always: list[int] = ()) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent greedy tokens of ``data`` plus ``always``, sorted; and the share
    of the data's greedy tokens they cover."""
    counts = torch.bincount(data.greedy.cpu(), minlength=vocab_size)
    keep = set(torch.argsort(counts, descending=True, stable=True)[:size].tolist()) | {int(a) for a in always}
    ids = torch.tensor(sorted(keep), dtype=torch.long)
    return ids, float(counts[ids].sum()) / max(1, int(counts.sum()))


def _chain(head: DraftHead, target: SharedTarget, data: TeacherData, idx: torch.Tensor, lut: torch.Tensor):
    """Run the chain for start positions ``idx``; yields per step (logits, labels in the draft
    vocabulary (-100: outside it), out, target feature, confidence)."""
    idx = idx.to(data.hidden.device)
    hidden = data.hidden[idx - 1].to(target.dtype)
    cache: list = []
    for k in range(data.chain):
        pos = idx + k
        out = head.step(hidden, target.embed(data.tokens[pos]), cache)
        logits = target.logits(out)
        yield (
            k,
            logits,
            lut[data.greedy[pos]],
            out,
            data.hidden[pos].to(target.dtype),
            head.confidence_of(out, logits, k),
        )
        hidden = out


def train_head(
    head: DraftHead,
    target: SharedTarget,
    data: TeacherData,
    steps: int,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
    log_every: int = 25,
) -> list[dict]:
    """AdamW with warm-up and cosine decay; returns the logged records."""
    gen = torch.Generator().manual_seed(seed)
    device = data.hidden.device
    lut = _lookup(head, target).to(device)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))
    )
    head.train()
    records, t0 = [], time.time()
    for step in range(1, steps + 1):
        idx = data.starts[torch.randint(len(data.starts), (batch_size,), generator=gen)]
        loss = torch.zeros((), device=device)
        ok = torch.ones(batch_size, dtype=torch.bool, device=device)
        parts = []  # per chain step (ce, feature, bce, top-1), read back only when a step is logged
        for k, logits, labels, out, feat, conf in _chain(head, target, data, idx, lut):
            weight = 0.8**k  # later steps matter less: they are reached less often
            # means over the labelled rows (ce) and the rows still on a right chain (bce), written
            # as masked sums so that no step waits on the device to learn how many there are
            ce = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / (labels >= 0).sum().clamp(min=1)
            fr = F.smooth_l1_loss(_unit(out), _unit(feat))
            correct = logits.argmax(-1) == labels
            bce_rows = F.binary_cross_entropy(conf, correct.float(), reduction="none")
            bce = (bce_rows * ok).sum() / ok.sum().clamp(min=1)
            loss = loss + weight * (ce + 0.5 * fr) + bce
            parts.append(torch.stack([ce, fr, bce, correct.float().mean()]).detach())
            ok = ok & correct
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps:
            n, got = data.chain, torch.stack(parts).cpu()  # [chain, 4]: the one read-back of a logged step
            hits = got[:, 3].tolist()
            rec = {"step": step, "ce": float(got[:, 0].sum()) / n, "feature": float(got[:, 1].sum()) / n,
                   "bce": float(got[:, 2].sum()) / n, "top1_by_step": hits, "seconds": time.time() - t0}  # fmt: skip
            records.append(rec)
            log(f"  step {step}/{steps}  ce {rec['ce']:.3f}  feat {rec['feature']:.4f}  bce {rec['bce']:.3f}  "
                f"top1 {' '.join(f'{h:.2f}' for h in hits)}  {rec['seconds']:.0f} s")  # fmt: skip
    head.eval()
    return records


@torch.no_grad()
def evaluate_head(head: DraftHead, target: SharedTarget, data: TeacherData, batch_size: int = 512) -> dict:
    """Held-out figures: ``accept_by_position[k]`` = P(draft k right | drafts < k right),
    ``reach_by_position[k]`` = P(drafts 0..k all right), ``mean_accepted`` = expected leading
    right drafts per chain of ``data.chain`` (drafts accepted per verify step under greedy;
    tokens per step = 1 + it), ``ece`` over every (step reached, confidence) pair, by step too."""
    device = data.hidden.device
    lut = _lookup(head, target).to(device)
    confs: list[list[torch.Tensor]] = [[] for _ in range(data.chain)]
    rights: list[list[torch.Tensor]] = [[] for _ in range(data.chain)]
    accepted = torch.zeros(0)
    for b in range(0, len(data.starts), batch_size):
        idx = data.starts[b : b + batch_size]
        ok = torch.ones(len(idx), dtype=torch.bool, device=device)
        run = torch.zeros(len(idx), device=device)
        for k, logits, labels, _out, _feat, conf in _chain(head, target, data, idx, lut):
            correct = logits.argmax(-1) == labels
            confs[k].append(conf[ok])
            rights[k].append(correct[ok])
            ok = ok & correct
            run += ok.float()
        accepted = torch.cat([accepted, run.cpu()])
    conf_all = [torch.cat(c).cpu() for c in confs]
    right_all = [torch.cat(r).cpu() for r in rights]
    n = len(data.starts)
    return {
        "chains": n,
        "accept_by_position": [float(r.float().mean()) if len(r) else 0.0 for r in right_all],
        "reach_by_position": [float(r.sum()) / max(1, n) for r in right_all],
        "mean_accepted": float(accepted.mean()) if n else 0.0,
        "ece": expected_calibration_error(torch.cat(conf_all), torch.cat(right_all)),
        "ece_by_position": [expected_calibration_error(c, r) for c, r in zip(conf_all, right_all)],
        "mean_confidence_by_position": [float(c.mean()) if len(c) else 0.0 for c in conf_all],
    }


def expected_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, bins: int = 10) -> float:
    """ECE with ``bins`` equal-width bins over [0, 1]: sum over bins of (share of samples in the
    bin) x |accuracy in the bin - mean confidence in the bin|; a confidence of exactly 1 falls in
    the last bin. 0.0 for no samples."""
    if confidence.numel() == 0:
        return 0.0
    conf, right = confidence.double().flatten(), correct.double().flatten()
    which = (conf * bins).floor().clamp(max=bins - 1).long()
    total = 0.0
    for b in range(bins):
        sel = which == b
        if bool(sel.any()):
            total += float(sel.double().mean()) * abs(float(right[sel].mean()) - float(conf[sel].mean()))
    return total


def _lookup(head: DraftHead, target: SharedTarget) -> torch.Tensor:  # full vocabulary id -> draft index or -100
    lut = torch.full((head.cfg.vocab_size,), -100, dtype=torch.long)
    lut[head.vocab_ids.cpu()] = torch.arange(head.vocab_ids.numel())
    return lut


def _unit(x: torch.Tensor) -> torch.Tensor:  # a vector's direction at unit RMS (what the head's norms see)
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
