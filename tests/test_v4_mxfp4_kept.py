"""DeepSeek-V4's MXFP4 routed experts kept packed (``models.mxfp4``) where a platform offers
``FusedOps.mxfp4_moe``, and dequantized at load, exactly as before, where none does.

No Triton here: a test provider offers an ``mxfp4_moe`` on the CPU (never called: the builtin
MoE dispatcher then widens the packed experts per call through ``ExpertWeights.dequantized``),
which is enough to drive the loader's seam. The GPU plugin's kernel has its own tests
(plugins/deepinfer_cuda_sm100/tests/test_mxfp4_moe.py).
"""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.fused_ops import FusedOps
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models.deepseek_v4.weights import read_headers
from deepinfer_core.models.mxfp4 import Mxfp4Experts
from deepinfer_core.moe import ExpertWeights
from deepinfer_core.plugin_host import PluginHost
from deepinfer_core.quant import dequant_fp4, quant_fp4, scale_to_float
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint

LENS = (7, 30)
NEW = 4
_ROUTED = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")


class OffersOps:
    """A platform plugin's fused ops on any platform (CPU here)."""

    def __init__(self, ops: FusedOps) -> None:
        self.ops = ops

    @hookimpl
    def deepinfer_fused_ops(self, platform):
        return self.ops


def _not_called(*args, **kwargs):
    raise AssertionError("the builtin MoE dispatcher runs the experts, not FusedOps.mxfp4_moe")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4_mxfp4")
    write_tiny_v4_checkpoint(path, weights="fp8", experts="fp4", seed=5)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, TINY_V4_CONFIG["vocab_size"], (n,), generator=g).tolist() for n in LENS]
    return str(path), prompts


def _llm(path, ops: FusedOps | None):
    host = PluginHost(load_entry_points=False, extra_plugins={"ops": OffersOps(ops)} if ops is not None else None)
    return LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, host=host, fused_ops=False)


def _greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _file_expert_bytes(path: str) -> int:
    """The routed experts' bytes in the files (packed weights + UE8M0 scales), the MTP block's too."""
    headers = read_headers(sorted(glob.glob(os.path.join(path, "*.safetensors"))))
    return sum(
        meta["data_offsets"][1] - meta["data_offsets"][0] for name, (_, meta) in headers.items() if _ROUTED.match(name)
    )


def test_without_the_capability_experts_are_dequantized_as_before(checkpoint):
    """No plugin, or fused ops without ``mxfp4_moe``: float experts, no packed module."""
    path, prompts = checkpoint
    for ops in (None, FusedOps()):
        model = _llm(path, ops).engine.model
        assert not [m for m in model.modules() if isinstance(m, Mxfp4Experts)]
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape[-1] == 256


def test_kept_packed_holds_the_file_bytes_and_matches_the_dequantized_engine(checkpoint):
    path, prompts = checkpoint
    packed = _llm(path, FusedOps(mxfp4_moe=_not_called))
    kept = [m for n, m in packed.engine.model.named_modules() if isinstance(m, Mxfp4Experts)]
    mtp = [n for n, m in packed.engine.model.named_modules() if isinstance(m, Mxfp4Experts) and n.startswith("mtp.")]
    assert len(kept) == TINY_V4_CONFIG["num_hidden_layers"] + 1 and mtp == ["mtp.0.mlp.experts"]  # and the MTP block
    held = sum(b.numel() * b.element_size() for m in kept for b in m.buffers())
    assert all(b.dtype == torch.uint8 for m in kept for b in m.buffers())
    assert held == _file_expert_bytes(path)
    dense = _llm(path, None)
    for p in prompts:
        assert torch.allclose(packed.engine.prompt_logits(p), dense.engine.prompt_logits(p), rtol=0, atol=1e-5)
    assert _greedy(packed, prompts) == _greedy(dense, prompts)


def test_expert_weights_dequantize_mxfp4():
    g = torch.Generator().manual_seed(0)
    gu, dn = torch.randn(3, 64, 96, generator=g), torch.randn(3, 96, 32, generator=g)
    (pg, sg), (pd, sd) = quant_fp4(gu), quant_fp4(dn)
    w = ExpertWeights(pg.view(torch.uint8), pd.view(torch.uint8), sg.view(torch.uint8), sd.view(torch.uint8))
    assert w.is_mxfp4
    plain = w.dequantized(torch.bfloat16)
    assert plain.gate_up.dtype == torch.bfloat16 and plain.gate_up_scale is None
    assert torch.equal(plain.gate_up.float(), dequant_fp4(pg, sg))  # MXFP4 values are exact in bf16
    assert torch.equal(plain.down.float(), dequant_fp4(pd, sd))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_ue8m0_scales_are_exact_powers_of_two(device):
    """Every UE8M0 byte is exactly 2^(e - 127), the subnormal 2^-127 of e = 0 too (CUDA's exp2
    rounded it: the plugin's exact tile decode then disagreed with this reference on an H100),
    and 255 is inf; a float64 ldexp is the reference."""
    e = torch.arange(256, dtype=torch.uint8, device=device)
    got = scale_to_float(e).double().cpu()
    want = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127)
    assert torch.equal(got[:255], want[:255]) and got[255] == float("inf")


def test_the_mtp_block_kept_packed_drafts_as_the_dequantized_one(checkpoint):
    """The MTP block's FP8 projections and MXFP4 experts are kept packed like a main layer's
    (they were dequantized at load: 0.8 GB of V4-mini's 3.1 GB file held as 3.2x its bytes), and
    its forward gives the dequantized block's logits."""
    from test_deepseek_v4_mtp import BLOCK, meta_for

    from deepinfer_core.models.fp8 import Fp8Linear, dequantize

    path, prompts = checkpoint
    ops = FusedOps(
        fp8_linear=lambda x, w, s: torch.nn.functional.linear(x, dequantize(w, s).to(x.dtype)), mxfp4_moe=_not_called
    )
    packed, dense = _llm(path, ops).engine.model, _llm(path, None).engine.model
    kinds = {n: type(m) for n, m in packed.named_modules() if n.startswith("mtp.0.")}
    assert kinds["mtp.0.mlp.experts"] is Mxfp4Experts and kinds["mtp.0.self_attn.q_a_proj"] is Fp8Linear
    assert not any(isinstance(m, (Fp8Linear, Mxfp4Experts)) for m in dense.modules())
    ids = torch.tensor(prompts[1])
    T = len(ids) - 1
    meta = meta_for(T, prompt=T)
    got = []
    for model in (packed, dense):
        caches = model.kv_layout(BLOCK).allocate(2, 1, "cpu")
        (mtp_cache,) = model.mtp_kv_layout(BLOCK).allocate(2, 1, "cpu")
        with torch.no_grad():
            streams = model.hidden_streams(ids[:-1], meta.positions, caches, meta)
            got.append(model.mtp_forward(streams, ids[1:], meta.positions, mtp_cache, meta)[0])
    assert got[0].shape == (T, TINY_V4_CONFIG["vocab_size"])
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=1e-5)
    assert torch.equal(got[0].argmax(-1), got[1].argmax(-1))
