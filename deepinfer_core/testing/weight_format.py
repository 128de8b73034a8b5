"""Conformance suite for weight formats (``deepinfer_weight_format``).

Subclass :class:`WeightFormatSuite`, override the ``plugin`` fixture (the module or object that
holds the plugin's hooks) and set ``types`` (the GGUF types of the tiny random Llama checkpoint
the suite writes: ``{"*": "F32"}`` for a format that quantizes float weights at load, block
types such as ``{"*": "Q8_0"}`` for one that packs them), ``dtype`` (the engine dtype it serves
under) and ``min_cosine`` (how close its logits must stay to the float32 model's). The plugin is
registered in-process as ``plugin_name`` and asked by that name (``LLM(weight_format=...)``),
with the builtin low-bit format blocked so that only yours answers.
"""

from __future__ import annotations

import pytest
import torch

from ..weight_format import WeightFormat

__all__ = ["PROMPT", "TINY", "WeightFormatSuite"]

TINY = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2, vocab=512, tied=False)
PROMPT = list(range(3, 70, 2))  # 34 token ids of the random vocabulary


class WeightFormatSuite:
    plugin_name: str = "vendor"
    types: dict[str, str] = {"*": "F32"}
    dtype: str = "float32"
    min_cosine: float = 0.99

    @pytest.fixture
    def plugin(self):
        pytest.fail("a WeightFormatSuite subclass must override the `plugin` fixture")

    @pytest.fixture
    def checkpoint(self, tmp_path) -> str:
        from .gguf_files import write_random_llama_gguf

        return write_random_llama_gguf(str(tmp_path / "tiny.gguf"), types=self.types, **TINY)

    def host(self, plugin):
        from ..plugin_host import PluginHost

        return PluginHost(load_entry_points=False, extra_plugins={self.plugin_name: plugin}, blocked=("core.lowbit",))

    def llm(self, checkpoint: str, host, **options):
        from .. import LLM

        return LLM(checkpoint, device="cpu", kv_cache_blocks=4, max_num_seqs=4, host=host, **options)

    def test_answers_a_usable_weight_format_when_asked(self, plugin, checkpoint):
        from ..engine.loading import weights_request
        from ..models.loaders.formats import open_model_files

        host = self.host(plugin)
        request = weights_request(open_model_files(checkpoint), self.dtype, requested=self.plugin_name)
        fmt = host.weight_format(request, host.platform("cpu"), name=self.plugin_name)
        assert isinstance(fmt, WeightFormat), f"{type(fmt).__name__} does not implement WeightFormat"
        assert fmt.unavailable is None, fmt.unavailable
        assert isinstance(fmt.name, str) and fmt.name and isinstance(fmt.description, str) and fmt.description
        assert fmt.compute_dtype is None or isinstance(fmt.compute_dtype, torch.dtype)

    def test_a_model_loads_through_it_and_its_logits_stay_close_to_float32(self, plugin, checkpoint):
        host = self.host(plugin)
        engine = self.llm(checkpoint, host, dtype=self.dtype, weight_format=self.plugin_name).engine
        reference = self.llm(checkpoint, host, dtype="float32").engine
        assert engine.weight_format is not None and reference.weight_format is None
        assert engine.weight_format.describe(engine.model) != "dense"
        assert engine.weights_choice == engine.weight_format.description
        want, got = reference.prompt_logits(PROMPT), engine.prompt_logits(PROMPT)  # [T, V] float32
        assert got.dtype == torch.float32 and got.shape == want.shape and torch.isfinite(got).all()
        cosine = torch.nn.functional.cosine_similarity(want, got, dim=-1).min().item()
        assert cosine > self.min_cosine, f"logits' cosine to the float32 model {cosine:.4f} <= {self.min_cosine}"

    def test_a_batch_invariant_engine_gives_a_row_the_same_logits_alone_and_in_a_batch(self, plugin, checkpoint):
        from ..engine.sampling_params import SamplingParams

        llm = self.llm(checkpoint, self.host(plugin), dtype=self.dtype, weight_format=self.plugin_name)
        invariant = self.llm(
            checkpoint, self.host(plugin), dtype=self.dtype, weight_format=self.plugin_name, batch_invariant=True
        )
        assert invariant.engine.weight_format is not None
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = [PROMPT, PROMPT[:9], PROMPT[5:30]]
        alone = invariant.generate([PROMPT], params)[0].outputs[0].token_ids
        batched = invariant.generate(prompts, params)[0].outputs[0].token_ids
        assert alone == batched
        assert len(llm.generate([PROMPT], params)[0].outputs[0].token_ids) == 6
