"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import sys
from typing import Iterator, Sequence, Union

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = Union[str, Sequence[int], dict]  # text, token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}
Conversation = Sequence[dict]


class LLM:
    """One engine instance. ``model`` is a path (GGUF file or Hugging Face directory) or an
    alias of an installed model (``"smollm2-135m-instruct"``)."""

    def __init__(
        self,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_blocks: int | None = None,
        block_size: int = 128,
        max_model_len: int | None = None,
        batch_invariant: bool = False,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        attention_backend: str | None = None,
        moe_backend: str | None = None,
        host=None,
    ) -> None:
        config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_blocks=kv_cache_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            batch_invariant=batch_invariant,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            attention_backend=attention_backend,
            moe_backend=moe_backend,
        )
        self.engine = LLMEngine(config, host)

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- prompts -----------------------------------------------------------------------------
    def _encode(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):  # vLLM's TokensPrompt / TextPrompt
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                return self._encode(prompt["prompt"], add_special_tokens)
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            tok = self.engine.tokenizer
            if tok is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return tok.encode(prompt, add_special_tokens=add_special_tokens), prompt
        if isinstance(prompt, (list, tuple)):
            return list(prompt), None
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    @staticmethod
    def _as_list(prompts) -> list[Prompt]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _submit(self, encoded: list[tuple[list[int], str | None]], params) -> list[str]:
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(encoded)
        if len(params) != len(encoded):
            raise ValueError(f"got {len(params)} sampling params for {len(encoded)} prompts")
        for i, ((ids, _), p) in enumerate(zip(encoded, params)):  # all or nothing
            try:
                self.engine.validate(ids, p)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
        return [self.engine.add_request(ids, p, prompt=text) for (ids, text), p in zip(encoded, params)]

    # -- running -----------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of ``prompts``."""
        encoded = [self._encode(p) for p in self._as_list(prompts)]
        return self._run(self._submit(encoded, sampling_params), use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` dicts) or a list of them,
        rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        encoded = [self._encode_chat(c, add_generation_prompt) for c in conversations]
        return self._run(self._submit(encoded, sampling_params), use_tqdm)

    def _encode_chat(self, conversation: Conversation, add_generation_prompt: bool) -> tuple[list[int], str]:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer or chat template")
        text = tok.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt)
        return tok.encode(text, add_special_tokens=False), text

    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield a snapshot each time a request gains tokens (``.outputs[0].delta_text`` holds
        the new text); the last snapshot of a request has ``finished=True``. Breaking out of the
        loop aborts what is still running."""
        encoded = [self._encode(p) for p in self._as_list(prompts)]
        ids = self._submit(encoded, sampling_params)
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for request_id in pending:
                self.engine.abort_request(request_id)

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        if use_tqdm is None:
            use_tqdm = len(ids) > 1 and sys.stderr.isatty()
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in wanted - set(done):
                self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
