"""A tiny DeepSeek-V4 (sliding, CSA and HCA layers) whose attention runs on the Triton V4
kernels gives the reference's float32 greedy tokens: whole and chunked prefill, then decode with
requests batched together.

Without a GPU the kernels run in Triton's interpreter on the CPU, through a test provider that
offers :class:`TritonV4Attention` for V4 layers on any platform (the plugin itself answers only
for CUDA), and the tokens are transformers' (whose equality with the builtin path
tests/test_deepseek_v4.py checks). On a GPU the plugin's own hooks run and the tokens are the
builtin reference path's on the same GPU (CPU and GPU float32 sums differ in the last bits).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")
transformers = pytest.importorskip("transformers")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.hookspecs import hookimpl  # noqa: E402
from deepinfer_core.plugin_host import PluginHost  # noqa: E402
from deepinfer_core.testing.v4_tiny import randomise_zero_initialised, tiny_v4_config  # noqa: E402
from deepinfer_cuda_sm100.attention import TritonV4Attention  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
LENS = (9, 70) if not CUDA else (9, 70, 150, 300)
NEW = 6 if not CUDA else 24


class TritonV4Anywhere:
    """Offers the Triton V4 backend for V4 layers on every platform (CPU: the interpreter)."""

    @hookimpl
    def deepinfer_attention_backend(self, layer, platform):
        return TritonV4Attention() if layer.state_kv else None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(1234)
    model = transformers.DeepseekV4ForCausalLM(tiny_v4_config()).eval()
    randomise_zero_initialised(model, 5)
    path = tmp_path_factory.mktemp("dsv4-triton")
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in LENS]
    if CUDA:
        ref = LLM(
            str(path),
            device="cuda",
            dtype="float32",
            kv_cache_blocks=16,
            attention_backend="builtin",
            moe_backend="builtin",
        )
        want = [
            o.outputs[0].token_ids
            for o in ref.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        ]
        del ref
        return str(path), prompts, want
    want = []
    with torch.no_grad():
        for p in prompts:
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=NEW, do_sample=False, eos_token_id=None)  # fmt: skip
            want.append(ref[0, len(p) :].tolist())
    return str(path), prompts, want


def _llm(path, **kw):
    if CUDA:
        return LLM(path, device="cuda", dtype="float32", kv_cache_blocks=16, **kw)
    host = PluginHost(load_entry_points=False, extra_plugins={"v4triton": TritonV4Anywhere()})
    return LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, host=host, **kw)


def _backends(llm) -> set[str]:
    return {
        m.backend.name for m in llm.engine.model.modules() if hasattr(m, "backend") and hasattr(m.backend, "forward_v4")
    }


# CPU (interpreter, ~14 s a run): the chunked run only; its 9-token prompt is prefilled whole
@pytest.mark.parametrize("budget", [None, 32] if CUDA else [32], ids=["whole", "chunked"] if CUDA else ["chunked"])
def test_greedy_tokens_equal_the_reference(checkpoint, budget):
    path, prompts, want = checkpoint
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = _llm(path, **kw)
    assert _backends(llm) == {"cuda-sm100-triton-v4"}
    got = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    ]
    assert got == want
