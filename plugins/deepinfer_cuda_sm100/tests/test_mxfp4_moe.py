"""MXFP4 routed experts computed on their packed bytes (kernels/mxfp4.py inside fused_moe's
grouped GEMMs and moe_gemv's decode GEMVs), against the core's dequantization
(``deepinfer_core.quant.dequant_fp4``) and the torch reference MoE.

Without a GPU the kernels run in Triton's interpreter on the CPU (conftest.py): these tests have
so far run only there. The tiny-checkpoint test then offers the plugin's MoE dispatcher and
``FusedOps.mxfp4_moe`` through a test provider on the CPU platform (the plugin itself answers
only for CUDA); on a GPU it uses the plugin's own hooks.
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.fused_ops import FusedOps  # noqa: E402
from deepinfer_core.hookspecs import hookimpl  # noqa: E402
from deepinfer_core.models.deepseek_v4.weights import read_headers  # noqa: E402
from deepinfer_core.models.mxfp4 import Mxfp4Experts  # noqa: E402
from deepinfer_core.moe import ExpertWeights, MoESpec  # noqa: E402
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher  # noqa: E402
from deepinfer_core.plugin_host import PluginHost  # noqa: E402
from deepinfer_core.quant import dequant_fp4, quant_fp4  # noqa: E402
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint  # noqa: E402
from deepinfer_cuda_sm100.kernels.fused_moe import fused_moe, mxfp4_moe  # noqa: E402
from deepinfer_cuda_sm100.kernels.mxfp4 import dequant_mxfp4  # noqa: E402
from deepinfer_cuda_sm100.moe import TritonMoEDispatcher  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def packed_experts(E: int, D: int, I: int, seed: int) -> ExpertWeights:
    """Random experts quantized to MXFP4 as the released checkpoints store them, held as the
    engine holds them (uint8 codes, uint8 UE8M0 exponents), with groups of varied magnitude."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * I, D, generator=g) * D**-0.5
    dn = torch.randn(E, D, I, generator=g) * I**-0.5
    gu = gu * torch.exp2(torch.randint(-3, 3, (E, 2 * I, D // 32), generator=g).float()).repeat_interleave(32, -1)
    (pg, sg), (pd, sd) = quant_fp4(gu), quant_fp4(dn)
    as_bytes = [t.view(torch.uint8).to(DEVICE) for t in (pg, pd, sg, sd)]
    return ExpertWeights(*as_bytes)


def test_tile_decode_equals_the_core_dequantization():
    """Every byte (both nibbles, signs, the subnormal 0.5, -0) under extreme and ordinary
    exponents (0 is 2^-127, a float32 subnormal; 250 keeps 6 * 2^123 finite), and a random weight with partial tiles."""
    codes = torch.arange(256, dtype=torch.uint8).reshape(4, 64).to(DEVICE)
    scales = torch.tensor([[0, 1, 127, 250], [126, 128, 100, 150], [127] * 4, [3, 250, 60, 190]], dtype=torch.uint8)
    scales = scales.to(DEVICE)
    assert torch.equal(dequant_mxfp4(codes, scales), dequant_fp4(codes, scales))  # exponents past 128: two multiplies
    low = torch.tensor([[0, 1, 2, 128], [126, 128, 100, 12], [127] * 4, [3, 127, 60, 0]], dtype=torch.uint8)
    low = low.to(DEVICE)  # every exponent at most 128: the one-multiply path, to its edges (2^-1 and 2^127)
    assert torch.equal(dequant_mxfp4(codes, low), dequant_fp4(codes, low))
    w = packed_experts(1, 96, 32, seed=1)
    got = dequant_mxfp4(w.gate_up[0], w.gate_up_scale[0], block_n=16, block_k=64)  # 96 inputs: a partial K tile
    assert torch.equal(got, dequant_fp4(w.gate_up[0], w.gate_up_scale[0]))
    got = dequant_mxfp4(w.down[0], w.down_scale[0], block_n=64, block_k=64)  # 96 rows, 32 inputs: partial both ways
    assert torch.equal(got, dequant_fp4(w.down[0], w.down_scale[0]))


SHAPES = [  # (T, E, D, I, swiglu_limit): T * k = 2 rows take the decode GEMVs for 16-bit activations
    (1, 4, 64, 96, None),
    (5, 8, 96, 64, 0.3),
    (33, 6, 128, 32, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T, E, D, I, limit", SHAPES, ids=[f"T{s[0]}-E{s[1]}" for s in SHAPES])
def test_packed_experts_equal_the_reference_on_dequantized_weights(T, E, D, I, limit, dtype):
    experts = packed_experts(E, D, I, seed=T)
    spec = MoESpec(0, E, 2, D, I, swiglu_limit=limit)
    g = torch.Generator().manual_seed(100 + T)
    x = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]).to(DEVICE)
    weights = torch.rand(T, 2, generator=g).to(DEVICE)
    out = TritonMoEDispatcher().forward(spec, x, ids, weights, experts)
    plain = experts.dequantized(dtype)  # the core's dequantization, in the activation dtype
    ref = TorchMoEDispatcher().forward(spec, x, ids, weights, plain)
    assert out.dtype == dtype and out.shape == (T, D)
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())  # float32 sum orders
    else:  # bf16: a rounding of the reference's; and bit for bit the same kernel on the widened weights
        assert torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
        same, _ = fused_moe(x, plain.gate_up, plain.down, ids, weights, limit)
        assert torch.equal(out, same)


def test_the_fused_op_is_the_dispatcher_forward_and_refuses_plain_experts():
    experts = packed_experts(4, 64, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=g).to(DEVICE)
    ids = torch.tensor([[0, 1], [2, 3], [1, 3]], device=DEVICE)
    weights = torch.rand(3, 2, generator=g).to(DEVICE)
    want = TritonMoEDispatcher().forward(MoESpec(0, 4, 2, 64, 64, swiglu_limit=1.0), x, ids, weights, experts)
    assert torch.equal(mxfp4_moe(x, experts, ids, weights, 1.0), want)
    with pytest.raises(ValueError, match="not packed MXFP4"):
        mxfp4_moe(x, experts.dequantized(torch.float32), ids, weights)
    bad = ExpertWeights(experts.gate_up, experts.down, experts.gate_up_scale[:, :, :1], experts.down_scale)
    with pytest.raises(ValueError, match="gate_up_scale must be contiguous uint8"):
        mxfp4_moe(x, bad, ids, weights)


# ---- a tiny DeepSeek-V4 checkpoint, experts kept packed --------------------------------------

_ROUTED = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")
LENS = (5, 12)
NEW = 2


class MXFP4Anywhere:
    """The plugin's MoE dispatcher and ``mxfp4_moe`` on every platform (CPU: the interpreter)."""

    @hookimpl
    def deepinfer_moe_dispatcher(self, moe, platform, parallel):
        return TritonMoEDispatcher()

    @hookimpl
    def deepinfer_fused_ops(self, platform):
        return FusedOps(mxfp4_moe=mxfp4_moe)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4_mxfp4_triton")
    write_tiny_v4_checkpoint(path, weights="fp8", experts="fp4", seed=21)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, TINY_V4_CONFIG["vocab_size"], (n,), generator=g).tolist() for n in LENS]
    return str(path), prompts


def _greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_tiny_v4_keeps_experts_packed_and_matches_the_dequantized_engine(checkpoint):
    """Packed experts hold the file's bytes (not ~8x them as float32) and give the dequantized
    engine's float32 logits and greedy tokens. CPU: the reference dequantizes at load (builtin
    host, no mxfp4_moe). GPU: the reference is the builtin dispatcher, which widens the packed
    experts per call (ExpertWeights.dequantized)."""
    path, prompts = checkpoint
    if CUDA:
        llm = LLM(path, device="cuda", dtype="float32", kv_cache_blocks=16)
        ref = LLM(path, device="cuda", dtype="float32", kv_cache_blocks=16, moe_backend="builtin", fused_ops=False)
    else:
        host = PluginHost(load_entry_points=False, extra_plugins={"mxfp4": MXFP4Anywhere()})
        llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, host=host, fused_ops=False)
        ref = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, host=PluginHost(load_entry_points=False))
    kept = [m for m in llm.engine.model.modules() if isinstance(m, Mxfp4Experts)]
    assert len(kept) == TINY_V4_CONFIG["num_hidden_layers"] + 1  # every main layer and the MTP block
    assert all(b.dtype == torch.uint8 for m in kept for b in m.buffers())
    headers = read_headers(sorted(glob.glob(os.path.join(path, "*.safetensors"))))
    file_bytes = sum(m["data_offsets"][1] - m["data_offsets"][0] for n, (_, m) in headers.items() if _ROUTED.match(n))
    assert sum(b.numel() * b.element_size() for m in kept for b in m.buffers()) == file_bytes
    assert any(isinstance(layer.mlp.dispatcher, TritonMoEDispatcher) for layer in llm.engine.model.model.layers)
    p = prompts[1]
    assert torch.allclose(llm.engine.prompt_logits(p), ref.engine.prompt_logits(p), rtol=0, atol=1e-4)
    assert _greedy(llm, prompts) == _greedy(ref, prompts)
