"""The int8-activation kernel for 4-bit weights (lowbit/kernels_i8.c).

References independent of the kernel: the ``gguf`` library's quantizers for the weights, float64
sums of the kernel's own rounded integers times the same scales (so the only tolerance is
float32 accumulation), and a float64 matmul with the dequantized weights bounded by the
activations' rounding (half an int8 step per block).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from deepinfer_core.lowbit import native, ops  # noqa: E402
from deepinfer_core.lowbit.formats import QuantWeight, from_gguf  # noqa: E402

KERNELS = native.load()
pytestmark = pytest.mark.skipif(KERNELS.lib is None, reason=f"low-bit kernels unavailable here: {KERNELS.reason}")


def _act8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    M, K = x.shape
    v, s, sx = torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // 32), torch.empty(M, K // 32)
    KERNELS.lib.quantize_act8(x.data_ptr(), M, K, v.data_ptr(), s.data_ptr(), sx.data_ptr())
    return v, s, sx


def _packed(type_name: str, n: int, k: int, seed: int) -> QuantWeight:
    if type_name == "Q4_K":  # the gguf library has no Q4_K quantizer: random super-blocks, sane scales
        raw = np.random.default_rng(seed).integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
        raw[..., 0:4] = np.frombuffer(np.full(2, 0.01, np.float16).tobytes(), np.uint8)
        raw = raw.reshape(n, -1)
    else:
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    return from_gguf(type_name, raw, (n, k))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("M", [1, 5, 11, 262])
def test_int8_kernel_equals_float64_sums_of_its_own_integers(type_name, M):
    """Odd shapes: N = 37 rows (not a multiple of the 8-row tile), K = 11 blocks (2 Q4_K
    super-blocks), M not a multiple of the 4-token group and, at 262, past one 256-token pass."""
    k = 512 if type_name == "Q4_K" else 352
    n = 37
    packed = _packed(type_name, n, k, seed=M)
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)) * 3
    x[:, 7] *= 20
    v, s, sx = _act8(x)
    nb = k // 32
    q = torch.cat([packed.qs & 0x0F, packed.qs >> 4], dim=-1).long()  # [N, nb, 32]
    ints = torch.einsum("nbj,mbj->mnb", q, v.long().reshape(M, nb, 32))  # exact integer block sums
    terms = (
        ints.double() * packed.d.double()[None] * s.double()[:, None, :]
        + packed.m.double()[None] * sx.double()[:, None, :]
    )
    expected = terms.sum(-1)
    got = ops.matmul(x, packed, max_int_rows=0, min_int8_rows=1)
    assert got.shape == (M, n)
    bound = 1e-6 * terms.abs().sum(-1) + 1e-6  # float32 accumulation of the per-block terms only
    assert ((got.double() - expected).abs() <= bound).all(), float((got.double() - expected).abs().max())
    # and it is the float64 product up to the activations' rounding (half a step of each block)
    dense = packed.dequantize().double()
    step = x.double().reshape(M, nb, 32).abs().amax(-1) / 127  # [M, nb]
    slack = (
        step[:, None, :]
        * 0.501
        * (dense - packed.m.double().repeat_interleave(32, -1)).abs().reshape(n, nb, 32).sum(-1)[None]
    ).sum(-1)
    assert ((got.double() - x.double() @ dense.T).abs() <= slack + bound).all()


def test_int8_kernel_gives_each_row_the_same_result_alone_or_in_a_batch():
    packed = _packed("Q4_1", 40, 256, seed=8)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    together = ops.matmul(x, packed, min_int8_rows=1)
    for i in range(9):
        assert torch.equal(ops.matmul(x[i : i + 1], packed, min_int8_rows=1)[0], together[i])


def test_kernel_choice_by_rows_and_weight_kind():
    assert ops.kernel_for(4, "q4", 4, 5) == "i16"
    assert ops.kernel_for(5, "q4", 4, 5) == "i8" and ops.kernel_for(2048, "q4", 4, 5) == "i8"
    assert ops.kernel_for(5, "q8", 4, 5) == "exact"  # 8-bit weights keep float32 activations
    assert ops.kernel_for(64, "q4", 4, 0) == "exact"
    assert (
        ops.kernel_for(64, "q4", 10**9, 5) == "i8"
    )  # opted in: whatever int_rows says (the int16 default covers every row count)
    assert ops.kernel_for(64, "q8", 10**9, 5) == "i16" and ops.kernel_for(64, "q4", 10**9, 0) == "i16"
    # the dispatch really takes the int8 kernel: equal to a direct call, not to the exact kernel
    packed = _packed("Q4_1", 24, 128, seed=3)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(2))
    direct = torch.empty(6, 24)
    KERNELS.lib.gemm_i8_act(
        x.data_ptr(), 6, 128, packed.qs.data_ptr(), packed.d.data_ptr(), packed.m.data_ptr(), 24, direct.data_ptr(), 1
    )
    assert torch.equal(ops.matmul(x, packed, 4, 5), direct) and not torch.equal(ops.matmul(x, packed), direct)


def test_int8_rows_setting_is_read_from_the_environment_and_refused_by_name():
    assert ops.int8_rows({}) == ops.DEFAULT_INT8_ROWS == 0  # opt-in: it loses the float32 model's greedy tokens
    assert ops.int8_rows({"DEEPINFER_LOWBIT_INT8_ROWS": "5"}) == 5
    assert ops.int8_rows({"DEEPINFER_LOWBIT_EXACT": "1", "DEEPINFER_LOWBIT_INT8_ROWS": "9"}) == 0
    assert ops.int8_rows({"DEEPINFER_LOWBIT_INT8_ROWS": "0"}) == 0
    assert ops.int8_rows({"DEEPINFER_LOWBIT_INT8_ROWS": "16"}) == 16
    with pytest.raises(ValueError, match="DEEPINFER_LOWBIT_INT8_ROWS='-1'.*whole number >= 0"):
        ops.int8_rows({"DEEPINFER_LOWBIT_INT8_ROWS": "-1"})
    with pytest.raises(ValueError, match="DEEPINFER_LOWBIT_INT8_ROWS='x'"):
        ops.int8_rows({"DEEPINFER_LOWBIT_INT8_ROWS": "x"})
