"""The low-bit library's instruction-set builds (deepinfer_core.lowbit.native: AVX2, or AVX512-VNNI
where the CPU has it) give the same bits.

The reference is the AVX2 build, the kernels as they were before VNNI (``vpmaddwd`` + ``vpaddd``):
the VNNI build's ``vpdpwssd`` sums the same integers (its panel in 512-bit vectors, 8 tokens a
pass, each lane the 256-bit pass's operations in the same order), so every output must be bit-for-bit equal,
on the shapes the kernel tests use (odd N with a short last tile, the rows layout at 1-4 rows,
the panel from 5 with every token tail, K in one and in several slices of the panel, q4 with
offsets, q5 and q8), through the fused head and a whole decode step. The choice of build is read
from /proc/cpuinfo (checked against the kernel flags there) and ``DEEPINFER_LOWBIT_ISA``.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from deepinfer_core.lowbit import native
from deepinfer_core.lowbit.formats import KIND_CODE, QuantWeight, quantize_q8

BASE = native.load_isa("avx2")
HAS_VNNI = all(f in native.cpu_flags() for f in ("avx512f", "avx512vl", "avx512bw", "avx512_vnni"))
VNNI = native.load_isa("avx512vnni") if HAS_VNNI and BASE.lib is not None else None
needs_both = pytest.mark.skipif(
    VNNI is None or VNNI.lib is None,
    reason="this CPU lacks AVX512-VNNI + AVX512-VL (or the kernels cannot be built): nothing to compare"
    if not HAS_VNNI
    else f"a build failed: {BASE.reason or (VNNI and VNNI.reason)}",
)


def test_isa_choice_follows_the_cpu_flags_and_the_switch():
    zen3 = frozenset({"avx2", "fma", "f16c"})
    zen4 = zen3 | {"avx512f", "avx512vl", "avx512bw", "avx512_vnni", "avx512_bf16"}
    alder = zen3 | {"avx_vnni"}
    assert native.isa_choice({}, zen3) == "avx2"
    assert native.isa_choice({}, zen4) == "avx512vnni"
    assert native.isa_choice({}, alder) == "avxvnni"
    assert native.isa_choice({}, zen4 - {"avx512vl"}) == "avx2"  # vpdpwssd on ymm needs VL
    assert native.isa_choice({"DEEPINFER_LOWBIT_ISA": "auto"}, zen4) == "avx512vnni"
    assert native.isa_choice({"DEEPINFER_LOWBIT_ISA": "avx2"}, zen4) == "avx2"
    assert native.isa_choice({"DEEPINFER_LOWBIT_ISA": "avxvnni"}, alder) == "avxvnni"
    with pytest.raises(ValueError, match="DEEPINFER_LOWBIT_ISA='avx512vnni': this CPU lacks avx512f"):
        native.isa_choice({"DEEPINFER_LOWBIT_ISA": "avx512vnni"}, zen3)
    with pytest.raises(ValueError, match="allowed values are auto, avx2"):
        native.isa_choice({"DEEPINFER_LOWBIT_ISA": "sse"}, zen4)


def test_cpu_flags_are_those_of_proc_cpuinfo():
    with open("/proc/cpuinfo") as f:
        line = next((ln for ln in f if ln.startswith("flags")), "")
    assert native.cpu_flags() == frozenset(line.partition(":")[2].split())


@needs_both
def test_each_build_says_which_instructions_it_was_compiled_for():
    assert (BASE.isa, BASE.lib.lowbit_isa()) == ("avx2", 0)
    assert (VNNI.isa, VNNI.lib.lowbit_isa()) == ("avx512vnni", 1)


def _weight(kind: str, n: int, k: int, seed: int) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    if kind == "q8":
        return quantize_q8(torch.randn(n, k, generator=g))
    d = torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
    width = 20 if kind == "q5" else 16  # q5: random high bits too
    return QuantWeight(
        kind,
        torch.randint(0, 256, (n, k // 32, width), dtype=torch.uint8, generator=g),
        d,
        -8 * d + 0.002 * torch.randn(n, k // 32, generator=g),
        "Q5_1" if kind == "q5" else "Q4_1",
    )


def _gemm(lib: ctypes.CDLL, exact: bool, x: torch.Tensor, w: QuantWeight, threads: int) -> torch.Tensor:
    M, K = x.shape
    y = torch.full((M, w.qs.shape[0]), float("nan"))
    fn = lib.gemm_f32_act if exact else lib.gemm_i16_act
    fn(
        x.data_ptr(),
        M,
        K,
        KIND_CODE[w.kind],
        w.qs.data_ptr(),
        w.d.data_ptr(),
        w.m.data_ptr() if w.m is not None else None,
        w.qs.shape[0],
        y.data_ptr(),
        threads,
    )
    return y


@needs_both
@pytest.mark.parametrize("kind", ["q4", "q5", "q8"])
@pytest.mark.parametrize(
    "K", [352, 640, 1376, 1536]
)  # 11 blocks; one slice of 20; three of 15 and one short; three of 16
@pytest.mark.parametrize("threads", [1, 2])
def test_int16_kernel_bits_equal_between_builds(kind, K, threads):
    w = _weight(kind, 37, K, K)
    for M in (
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
        10,
        11,
        12,
        13,
        14,
        15,
        23,
        32,
        301,
    ):  # the panel's token tails of 5 (ymm) and 8 (zmm) passes
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M * K)) * 3
        x[:, 7] = 0.0  # a block of zeros among them: scale 0
        x[0, :32] = 0.0
        base, vnni = _gemm(BASE.lib, False, x, w, threads), _gemm(VNNI.lib, False, x, w, threads)
        assert not base.isnan().any()
        assert torch.equal(base.view(torch.int32), vnni.view(torch.int32)), (M, K, kind)


@pytest.mark.skipif(BASE.lib is None, reason=f"the AVX2 build failed: {BASE.reason}")
@pytest.mark.parametrize("kind", ["q4", "q5", "q8"])
def test_int16_kernel_on_rows_rounded_beforehand_keeps_its_bits(kind):
    """gemm_i16_pre (the fused head's entry: rows rounded once by quantize_act16, then the GEMM)
    against gemm_i16_act rounding them itself, in each build: the same bits, rows layout and panel."""
    w = _weight(kind, 37, 640, 11)
    n, nb = w.qs.shape[0], 640 // 32
    for lib in (BASE.lib,) + ((VNNI.lib,) if VNNI is not None and VNNI.lib is not None else ()):
        for M in (1, 3, 4, 5, 7, 32):
            x = torch.randn(M, 640, generator=torch.Generator().manual_seed(M)) * 3
            v, s, sx = torch.empty(M, 640, dtype=torch.int16), torch.empty(M, nb), torch.empty(M, nb)
            lib.quantize_act16(x.data_ptr(), M, 640, v.data_ptr(), s.data_ptr(), sx.data_ptr())
            got = torch.full((M, n), float("nan"))
            lib.gemm_i16_pre(
                v.data_ptr(),
                s.data_ptr(),
                sx.data_ptr(),
                M,
                640,
                KIND_CODE[w.kind],
                w.qs.data_ptr(),
                w.d.data_ptr(),
                w.m.data_ptr() if w.m is not None else None,
                n,
                got.data_ptr(),
                2,
            )
            want = _gemm(lib, False, x, w, 2)
            assert not want.isnan().any() and torch.equal(got.view(torch.int32), want.view(torch.int32)), (kind, M)


@needs_both
@pytest.mark.parametrize("kind", ["q4", "q5", "q8"])
def test_exact_kernel_bits_equal_between_builds(kind):
    """The rest of the library is compiled with the wider flags too: the float32 kernel keeps its bits."""
    w = _weight(kind, 37, 640, 5)
    for M in (1, 3, 4, 5, 32):
        x = torch.randn(M, 640, generator=torch.Generator().manual_seed(M))
        assert torch.equal(
            _gemm(BASE.lib, True, x, w, 2).view(torch.int32), _gemm(VNNI.lib, True, x, w, 2).view(torch.int32)
        )


@needs_both
@pytest.mark.parametrize("M", [1, 4, 5, 32])
def test_fused_head_picks_the_same_tokens_between_builds(M):
    """lowbit_head_argmax on a head whose logits are close together (many near-ties): the same
    index per row from both builds."""
    w = quantize_q8(torch.randn(4099, 576, generator=torch.Generator().manual_seed(3)) * 0.02)
    x = torch.randn(M, 576, generator=torch.Generator().manual_seed(M))
    outs = []
    for lib in (BASE.lib, VNNI.lib):
        out = torch.empty(M, dtype=torch.int64)
        assert (
            lib.lowbit_head_argmax(
                x.data_ptr(),
                M,
                576,
                8,
                w.qs.data_ptr(),
                w.d.data_ptr(),
                None,
                w.qs.shape[0],
                1 << 62,
                0,
                2,
                out.data_ptr(),
            )
            == 0
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], _gemm(BASE.lib, False, x, w, 2).argmax(-1))


def test_the_switch_is_refused_by_name_when_the_library_loads(monkeypatch):
    monkeypatch.setenv("DEEPINFER_LOWBIT_ISA", "avx1024")
    with pytest.raises(ValueError, match="DEEPINFER_LOWBIT_ISA='avx1024'"):
        native.load()


@pytest.mark.skipif(BASE.lib is None, reason=f"low-bit kernels unavailable here: {BASE.reason}")
def test_the_loaded_build_and_deepinfer_plugins_name_the_chosen_instructions(monkeypatch):
    from deepinfer_core.plugin_host import PluginHost

    def lowbit_row():  # deepinfer plugins' row of the builtin low-bit plugin (its probe)
        return next(i for i in PluginHost(load_entry_points=False).plugins() if i.name == "core.lowbit")

    monkeypatch.setenv("DEEPINFER_LOWBIT_ISA", "avx2")
    assert native.load().isa == "avx2" and native.load().lib.lowbit_isa() == 0
    assert lowbit_row().usable and "(kernels AVX2 (vpmaddwd))" in lowbit_row().reason
    if HAS_VNNI:
        monkeypatch.setenv("DEEPINFER_LOWBIT_ISA", "auto")
        assert native.load().isa == "avx512vnni" and native.load().lib.lowbit_isa() == 1
        assert "(kernels AVX512-VNNI (vpdpwssd))" in lowbit_row().reason


@needs_both
def test_an_engine_on_each_build_generates_the_same_tokens(monkeypatch):
    """SmolLM2's Q4_1/Q8_0 file end to end (native prefill and decode steps, the fused head): the
    engine built under each DEEPINFER_LOWBIT_ISA keeps that build for all its calls; 6 requests
    (decode in the panel layout, prefill rows in it too), greedy, the same token ids."""
    from deepinfer_core import LLM, SamplingParams

    prompts = [f"Write {n} short facts about the number {n * 7}." for n in range(1, 7)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for isa in ("avx2", "avx512vnni"):
        monkeypatch.setenv("DEEPINFER_LOWBIT_ISA", isa)
        llm = LLM("smollm2-135m-instruct", device="cpu", max_num_seqs=6, kv_cache_blocks=48)
        tokens[isa] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.model.fused_step._lib.lowbit_isa() == (
            0 if isa == "avx2" else 1
        )  # the steps ran on that build
        del llm
    assert all(len(t) == 24 for t in tokens["avx2"])
    assert tokens["avx2"] == tokens["avx512vnni"]
