"""On a CUDA device: the engine paths that only a real GPU exercises.

- Overlapped scheduling (on by default off the CPU): greedy and seeded outputs with the debug
  guard on equal serial steps, with CUDA graphs replayed from device-fed ids.
- A tiny DeepSeek-V4 (sliding, CSA and HCA layers; FP8/FP4 checkpoint) through the plugin's
  defaults gives the builtin reference path's float32 greedy tokens.
Both are skipped without CUDA (CI has none); the CPU tests cover the same logic on the host.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_overlapped_steps_equal_serial_steps_on_cuda(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("triton")
    from deepinfer_core import LLM, SamplingParams

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12] * 30, [13], [20, 21] * 7, [30] * 40]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=10, seed=4, max_tokens=33),
              SamplingParams(temperature=0, max_tokens=25),
              SamplingParams(temperature=0.7, top_p=0.8, seed=1, max_tokens=37, min_tokens=5),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[50, 51, 52])]  # fmt: skip
    on = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=16, max_num_seqs=8, overlap_debug=True)
    assert on.engine.overlap and on.engine.runner.graphs is not None
    fed = []
    launch = on.engine.runner.launch
    on.engine.runner.launch = lambda out, rows, replay=None, input_ids=None: (
        fed.append(input_ids is not None) or launch(out, rows, replay, input_ids)
    )
    off = LLM(
        str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=16, max_num_seqs=8, overlap_scheduling=False
    )
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in on.generate(prompts, params)]
    want = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in off.generate(prompts, params)]
    assert got == want
    assert sum(fed) >= 20, f"{sum(fed)} of {len(fed)} steps were fed from the device"


def test_deepseek_v4_tiny_through_the_plugin_equals_the_builtin_path(tmp_path):
    pytest.importorskip("triton")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint

    config = write_tiny_v4_checkpoint(tmp_path, config=dict(TINY_V4_CONFIG))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, config["vocab_size"], (n,), generator=g).tolist() for n in (5, 40, 130, 300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", kv_cache_blocks=32, max_num_seqs=8, block_size=128)
    ref = LLM(str(tmp_path), attention_backend="builtin", moe_backend="builtin", **kw)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    del ref
    ours = LLM(str(tmp_path), **kw)
    names = sorted({getattr(m.backend, "name", "") for m in ours.engine.model.modules() if hasattr(m, "backend")})
    got = [o.outputs[0].token_ids for o in ours.generate(prompts, params)]
    assert got == want, f"backends {names}"
