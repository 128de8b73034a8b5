"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``.

One ``LLM`` may be used from several threads and iterators at once (``generate`` on two
threads, a ``stream`` read between ``generate`` calls, a stream dropped half-way): they share
the engine's batches through :class:`.request_streams.RequestStreams`, and each gets exactly
the outputs it would get alone.
"""

from __future__ import annotations

import sys
from typing import Iterator, Sequence, Union

from .config import engine_config, with_engine_options
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .request_streams import RequestStreams
from .sampling_params import SamplingParams

Prompt = Union[str, Sequence[int], dict]  # text, token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}
Conversation = Sequence[dict]


class LLM:
    """One engine instance. ``model`` is a path (GGUF file or Hugging Face directory) or an
    alias of an installed model (``"smollm2-135m-instruct"``)."""

    @with_engine_options
    def __init__(self, model: str, *, host=None, **engine_options) -> None:
        """``engine_options`` are :class:`.config.EngineConfig`'s fields (listed below); an
        unknown name is a TypeError naming it and the closest known ones."""
        config = engine_config(model, **engine_options)
        if config.world_size > 1:  # one worker process per rank, this process drives them
            from .parallel.driver import ParallelEngine

            self.engine = ParallelEngine(config, host)
        else:
            self.engine = LLMEngine(config, host)
        self._streams = RequestStreams(self.engine)

    def shutdown(self) -> None:
        """Stop a parallel engine's rank processes now (also done at exit); nothing for one process."""
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- prompts -----------------------------------------------------------------------------
    def _encode(self, prompt: Prompt, split_special_tokens: bool = False) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):  # vLLM's TokensPrompt / TextPrompt
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"a prompt dict's 'prompt' is a string, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
                    raise TypeError(
                        f"a prompt dict's 'prompt_token_ids' is a list of integers, got {type(ids).__name__}"
                    )
                return list(ids), text
            if "prompt" in prompt:
                return self._encode(text, split_special_tokens)
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(map(str, prompt))}")
        if isinstance(prompt, str):
            tok = self.engine.tokenizer
            if tok is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            self.engine.check_prompt_text(prompt)
            return tok.encode(prompt, add_special_tokens=True, split_special_tokens=split_special_tokens), prompt
        if isinstance(prompt, (list, tuple)):
            return list(prompt), None
        raise TypeError(f"a prompt is a string, a list of token ids or a prompt dict, got {type(prompt).__name__}")

    @staticmethod
    def _as_list(prompts) -> list[Prompt]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and not isinstance(prompts[0], (str, dict, list, tuple))
        ):
            return [prompts]  # one prompt (a list of token ids is one prompt)
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                "prompts are a string, a list of token ids, a prompt dict, or a list of those; got "
                f"{type(prompts).__name__}"
            )
        return list(prompts)

    def _submit(self, encoded: list[tuple[list[int], str | None]], params, final_only: bool = False) -> list[str]:
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(encoded)
        if not isinstance(params, (list, tuple)):
            raise TypeError(
                "sampling_params must be a SamplingParams, a list of them (one per prompt), or None; got "
                f"{type(params).__name__}"
            )
        if len(params) != len(encoded):
            raise ValueError(f"got {len(params)} sampling params for {len(encoded)} prompts")
        checked = self.engine.check_batch([(ids, p) for (ids, _), p in zip(encoded, params)])  # all or nothing

        def add_all() -> list[str]:
            ids: list[str] = []
            try:
                for request, (_, text) in zip(checked, encoded):
                    ids.append(self.engine.add_checked(request, prompt=text, final_only=final_only))
            except BaseException:
                for request_id in ids:
                    self.engine.abort_request(request_id)
                raise
            return ids

        return self._streams.submit(add_all)

    # -- running -----------------------------------------------------------------------------
    def generate(
        self, prompts, sampling_params=None, use_tqdm: bool | None = None, *, split_special_tokens: bool = False
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of ``prompts``.

        Text prompts are tokenized like vLLM does: special-token text in them (``<|im_start|>``)
        becomes the special token. ``split_special_tokens=True`` encodes it as plain text
        instead (for text from users). A request the engine gives up on comes back with
        ``finish_reason="error"`` and the reason in ``outputs[0].error``."""
        encoded = [self._encode(p, split_special_tokens) for p in self._as_list(prompts)]
        return self._run(self._submit(encoded, sampling_params, final_only=True), use_tqdm)

    def chat(
        self, messages, sampling_params=None, use_tqdm: bool | None = None, add_generation_prompt: bool = True
    ) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` dicts) or a list of them,
        rendered with the model's chat template. Special tokens come only from the template:
        special-token text typed in a message is encoded as plain text."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError(
                "messages are a non-empty list of {'role', 'content'} dicts (or a list of such lists), got "
                f"{type(messages).__name__ if not isinstance(messages, (list, tuple)) else 'an empty list'}"
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        encoded = [self._encode_chat(c, add_generation_prompt) for c in conversations]
        return self._run(self._submit(encoded, sampling_params, final_only=True), use_tqdm)

    def _encode_chat(self, conversation: Conversation, add_generation_prompt: bool) -> tuple[list[int], str]:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer or chat template")
        from ..chat_prompt import check_conversation, encode_chat

        conversation = check_conversation(conversation)
        self.engine.check_prompt_text("".join(m["content"] for m in conversation))
        return encode_chat(tok, conversation, add_generation_prompt)  # message text stays text

    def stream(self, prompts, sampling_params=None, *, split_special_tokens: bool = False) -> Iterator[RequestOutput]:
        """Yield a snapshot each time a request gains tokens (``.outputs[0].delta_text`` holds
        the new text); the last snapshot of a request has ``finished=True``. Breaking out of the
        loop (or dropping the iterator) aborts what is still running. The prompts are
        validated and queued at the call, before the first ``next()``."""
        encoded = [self._encode(p, split_special_tokens) for p in self._as_list(prompts)]
        ids = self._submit(encoded, sampling_params)
        return self._stream(ids)

    def _stream(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = list(ids)
        try:
            while pending:
                for out in self._streams.next_outputs(pending):
                    if out.finished:
                        pending.remove(out.request_id)
                    yield out
        finally:
            self._streams.abort(pending)

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        if use_tqdm is None:
            use_tqdm = len(ids) > 1 and sys.stderr.isatty()
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                for out in self._streams.next_outputs([i for i in ids if i not in done]):
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self._streams.abort([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
