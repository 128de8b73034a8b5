"""Builtin catalogues: KV stores, speculative policies, model architectures and sources."""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..speculative import ConfidenceScheduledVerification, FixedLengthVerification


@hookimpl(trylast=True)
def deepinfer_register_kv_stores(register):
    from ..kv_store.local import LocalDiskKVStore
    from ..kv_store.memory import MemoryKVStore

    register("memory", MemoryKVStore)
    register("local", LocalDiskKVStore)


@hookimpl(trylast=True)
def deepinfer_register_spec_policies(register_drafter, register_verification):
    from .drafters import mtp_drafter, ngram_drafter

    register_drafter("ngram", ngram_drafter)
    register_drafter("mtp", mtp_drafter)
    register_drafter("draft", _learned_drafter)
    register_verification("fixed", lambda options=None: FixedLengthVerification())
    register_verification("confidence", lambda options=None: ConfidenceScheduledVerification())


def _learned_drafter(config, ctx):
    """The learned head for Llama-family targets (``models/llama/drafter.py``), imported on use."""
    from ..models.llama.drafter import build_draft_drafter

    return build_draft_drafter(config, ctx)


@hookimpl(trylast=True)
def deepinfer_register_models(register, register_source):
    from ..models.deepseek_v3 import model as deepseek_v3
    from ..models.deepseek_v4 import model as deepseek_v4
    from ..models.llama import model as llama
    from ..models.sources import smollm2_gguf

    register("LlamaForCausalLM", llama.build)
    register("Qwen2ForCausalLM", llama.build)
    register("DeepseekV3ForCausalLM", deepseek_v3.build)
    register("DeepseekV4ForCausalLM", deepseek_v4.build)
    register_source("smollm2-135m-instruct", smollm2_gguf)
