"""DeepSeek-V4's released FP8 projections kept FP8 on the GPU (e4m3 bytes + UE8M0 tile scales
through the plugin's ``fp8_linear``) and its MXFP4 routed experts kept packed (``mxfp4_moe``),
the MTP block's included.

GPU only: the plugin's fused ops (and so the FP8 GEMM that makes the engine keep FP8) answer for
CUDA platforms alone. Float32 greedy tokens of the plugin engine equal the builtin reference
path's (torch attention and MoE, no fused ops) on the same GPU, and the kept weights hold one
byte a value.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the plugin's FP8 GEMM answers for CUDA platforms only)", allow_module_level=True)

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.models.fp8 import Fp8Linear  # noqa: E402
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint  # noqa: E402

LENS = (9, 70, 150, 300)
NEW = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4_fp8_gpu")
    write_tiny_v4_checkpoint(path, weights="fp8", experts="fp4", seed=11)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, TINY_V4_CONFIG["vocab_size"], (n,), generator=g).tolist() for n in LENS]
    return str(path), prompts


def greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_fp8_projections_kept_and_tokens_equal_the_reference(checkpoint):
    path, prompts = checkpoint
    ref = LLM(
        path,
        device="cuda",
        dtype="float32",
        kv_cache_blocks=16,
        attention_backend="builtin",
        moe_backend="builtin",
        fused_ops=False,
    )
    want = greedy(ref, prompts)
    del ref
    llm = LLM(path, device="cuda", dtype="float32", kv_cache_blocks=16)
    kept = [m for m in llm.engine.model.modules() if isinstance(m, Fp8Linear)]
    assert kept and all(m.kernel is not None and m.qweight.dtype == torch.uint8 for m in kept)
    assert greedy(llm, prompts) == want
    assert llm.engine.overlap and llm.engine.runner.graphs is not None  # overlapped, decode in graphs


def test_mtp_block_kept_packed_drafts_as_the_reference(checkpoint):
    """The MTP block's FP8 projections and MXFP4 experts stay packed as a main layer's do (the
    plugin's FP8 GEMM and MXFP4 MoE kernel run them); MTP drafting over them proposes the
    reference path's drafts, call for call, and verifies to its tokens (float32)."""
    from deepinfer_core.models.mxfp4 import Mxfp4Experts

    path, prompts = checkpoint
    spec = {"method": "mtp", "num_speculative_tokens": 2, "verification": "fixed"}
    common = dict(device="cuda", dtype="float32", kv_cache_blocks=16, speculative_config=spec)

    def drafted(llm):
        calls, drafter = [], llm.engine.spec.drafter
        propose = drafter.propose

        def record(batch, num_tokens):
            ids, conf = propose(batch, num_tokens)
            calls.append(ids.cpu().tolist())
            return ids, conf

        drafter.propose = record
        return greedy(llm, prompts), calls

    ref = LLM(path, attention_backend="builtin", moe_backend="builtin", fused_ops=False, **common)
    want, want_drafts = drafted(ref)
    del ref
    llm = LLM(path, **common)
    mtp = {n: type(m) for n, m in llm.engine.model.named_modules() if n.startswith("mtp.0.")}
    assert mtp["mtp.0.mlp.experts"] is Mxfp4Experts and mtp["mtp.0.self_attn.q_a_proj"] is Fp8Linear
    got, got_drafts = drafted(llm)
    assert got == want and got_drafts == want_drafts and want_drafts


def test_bf16_fp8_engine_runs_in_graphs_and_overlap_equals_serial(checkpoint):
    path, prompts = checkpoint
    on = LLM(path, device="cuda", dtype="bfloat16", kv_cache_blocks=16, overlap_debug=True)
    off = LLM(path, device="cuda", dtype="bfloat16", kv_cache_blocks=16, overlap_scheduling=False)
    assert greedy(on, prompts) == greedy(off, prompts)


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_v4_batch_invariant_request_alone_equals_in_a_batch(tmp_path, weights):
    """``batch_invariant=True``: a V4 request's bf16 tokens do not depend on what it is batched
    with (every V4 kernel and GEMM in its fixed-order mode), for a bf16 and an FP8 + MXFP4 file."""
    write_tiny_v4_checkpoint(tmp_path, weights=weights, experts="fp4" if weights == "fp8" else "bf16", seed=5)
    llm = LLM(
        str(tmp_path), device="cuda", dtype="bfloat16", kv_cache_blocks=128, max_num_seqs=32, batch_invariant=True
    )
    g = torch.Generator().manual_seed(9)
    others = [torch.randint(2, TINY_V4_CONFIG["vocab_size"], (n,), generator=g).tolist() for n in range(3, 300, 10)]
    probe = torch.randint(2, TINY_V4_CONFIG["vocab_size"], (77,), generator=g).tolist()
    alone = greedy(llm, [probe])[0]
    together = greedy(llm, others[:15] + [probe] + others[15:])[15]
    assert alone == together
