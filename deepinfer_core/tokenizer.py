"""Text <-> token ids, chat templates and streaming detokenization.

One :class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` built either from a Hugging Face
directory (``tokenizer.json``) or from a GGUF file's metadata, where llama.cpp stores a GPT-2 style
byte-level BPE as a token list, a merge list and per-token types. The GGUF build reproduces what
transformers' GGUF loader makes of the same file, so both give the same ids (tested).

Streaming: one character may span several tokens (a 4-byte emoji is often 2 byte tokens), so
:class:`IncrementalDetokenizer` holds text back while it ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

# Markers that end an assistant turn in common chat templates; each becomes a stop id when the
# template uses it (SmolLM2's EOS already is <|im_end|>, Llama-3's is not <|eot_id|>).
_END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|eom_id|>", "<end_of_turn>")

# llama.cpp's `tokenizer.ggml.pre` names a split regex for vocabularies not trained on GPT-2's.
# Patterns are the published ones of each model family; unknown names keep GPT-2's built-in
# split, which is what transformers does too.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand for
    themselves, the other 68 bytes are shifted to code points 256.. so no token contains
    whitespace or control characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


class Tokenizer:
    """Encode/decode plus the model's special ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        add_bos_token: bool = False,
        extra_stop_ids: tuple[int, ...] = (),
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        # True only where the backend has no post-processor adding BOS itself (GGUF builds).
        self.add_bos_token = add_bos_token
        self.stop_token_ids = self._stop_ids(extra_stop_ids)

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, source: Any) -> "Tokenizer":
        """Byte-level BPE from a GGUF's ``tokenizer.ggml.*`` metadata: a path, the metadata as
        plain values (``models.gguf_index``'s mapping) or a ``gguf.GGUFReader``."""
        if isinstance(source, (str, os.PathLike)):
            from .models.loaders.gguf_index import read_index

            source = read_index(os.fspath(source), lambda key: key.startswith("tokenizer.")).metadata
        if isinstance(source, Mapping):
            field = source.get
        else:

            def field(name: str, default: Any = None) -> Any:
                f = source.fields.get(name)
                return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level 'gpt2')")
        tokens: list[str] = field("tokenizer.ggml.tokens")
        token_types: list[int] = field("tokenizer.ggml.token_type") or []
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]

        # Every BPE token is spelled in the byte alphabet; a token stored as raw text (a few
        # converters write added tokens that way) is re-spelled so BPE can reach it.
        alphabet = byte_alphabet()
        letters = set(alphabet.values())
        spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        split = _GGUF_SPLITS.get(field("tokenizer.ggml.pre"))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()

        # Control tokens (<|im_start|>) must match whole and are special (skipped on decode);
        # user-defined ones (<think>) match whole but stay visible. A "control" token spelled
        # outside the byte alphabet is a converter mislabel and is left alone.
        typed = list(zip(tokens, token_types))
        backend.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, kind_ in typed
                if kind_ == _GGUF_CONTROL and set(t) <= letters
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, normalized=False, special=False)
                for t, kind_ in typed
                if kind_ == _GGUF_USER_DEFINED and t in vocab
            ]
        )
        return cls(
            backend,
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_id=field("tokenizer.ggml.eos_token_id"),
            chat_template=field("tokenizer.chat_template"),
            add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        """``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``,
        ``generation_config.json`` for extra EOS ids) of a Hugging Face model directory."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(tok_file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return None if text is None else backend.token_to_id(text)

        gen_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
        extra = tuple(gen_eos) if isinstance(gen_eos, list) else (() if gen_eos is None else (gen_eos,))
        return cls(
            backend,
            bos_token_id=token_id(cfg.get("bos_token")),
            eos_token_id=token_id(cfg.get("eos_token")),
            chat_template=template,
            extra_stop_ids=extra,
        )

    # -- text <-> ids -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        """``split_special_tokens=True`` encodes special-token text (``<|im_start|>``) as
        ordinary text rather than as the special token (same meaning as in transformers)."""
        backend = self._plain_backend if split_special_tokens else self.backend
        ids = backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and ids[:1] != [self.bos_token_id]
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    @functools.cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that reads special-token text as text (a copy, because the
        flag is a setting of the object and the backend is shared by threads)."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most text characters one token can stand for (its longest spelling: a byte-level
        token spells one byte per character). A text of N characters has at least
        N / max_token_chars tokens, which bounds a prompt's length before tokenizing it."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1) or 1

    # -- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the model's Jinja template, with the variables and helpers
        Hugging Face templates expect (``bos_token``, ``eos_token``, ``raise_exception``...)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        variables = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
            **kwargs,
        }
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    # -- helpers -----------------------------------------------------------------------------
    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def _stop_ids(self, extra: tuple[int, ...]) -> tuple[int, ...]:
        ids = [self.eos_token_id, *extra]
        for marker in _END_OF_TURN_MARKERS:
            if self.chat_template and marker in self.chat_template:
                ids.append(self.backend.token_to_id(marker))
        return tuple(dict.fromkeys(i for i in ids if i is not None))


class IncrementalDetokenizer:
    """Turns a token stream into text chunks, emitting only complete characters.

    Decoding a short window ``ids[prefix:]`` and diffing it against ``ids[prefix:read]`` keeps the
    cost per token constant and lets decoders that depend on the previous token (leading-space
    handling) see it. While the decoded tail ends in U+FFFD the last token(s) are a partial UTF-8
    sequence: nothing is emitted until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this index have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before, now = self._window_texts()
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :]

    def _window_texts(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=self.skip_special_tokens)
        now = decode(self.ids[self._prefix :], skip_special_tokens=self.skip_special_tokens)
        return before, now

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of the stream)."""
        before, now = self._window_texts()
        self._prefix = self._read = len(self.ids)
        return now[len(before) :]


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """Templates are untrusted code from model repos: render them in Jinja's immutable sandbox,
    with the whitespace rules and helpers the Hugging Face ecosystem writes them for."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
