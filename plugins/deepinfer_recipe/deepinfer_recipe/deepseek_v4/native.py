"""Build and load ``_quiet.c`` (the V4 parser's C front) once per machine and interpreter.

Why C at all: a long tool argument is streamed a few characters per ``push``, and on a small CPU
one Python-level call per piece costs more than the whole one-shot parse of the text (measured
in ``benchmarks/serve/parser_streaming.py``). The helper is a CPython extension of one small type (the
parser's front), compiled when the first parser is made, with whatever C compiler the machine
has (``CC``, ``cc``, ``gcc``, ``clang``) against the running interpreter's headers, in well
under a second. It is cached under ``$DEEPINFER_CACHE_DIR`` (else ``$XDG_CACHE_HOME/deepinfer`` or
``~/.cache/deepinfer``) keyed by a hash of the source, flags and interpreter; a new build removes
all but the three most recently used older ones (``deepinfer_core.build_cache``). Nothing is
required: without a compiler or headers, or with ``DEEPINFER_NATIVE_PARSER=0``, the parser uses
its pure-Python quiet push, which behaves the same.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from types import ModuleType

from deepinfer_core import build_cache, envs

_SOURCE = os.path.join(os.path.dirname(__file__), "_quiet.c")
_FLAGS = ("-O2", "-shared", "-fPIC") + (("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ())


@dataclass(frozen=True)
class QuietHelper:
    """The loaded extension module, or why there is none (``module is None``)."""

    module: ModuleType | None
    reason: str = ""


def cache_dir() -> str:
    return os.path.join(envs.cache_dir(), "native")


def enabled() -> bool:
    return envs.get("DEEPINFER_NATIVE_PARSER")


@functools.cache
def load() -> QuietHelper:
    """Compile (first time) and import the helper; cached for the process. Never raises."""
    if sys.platform == "win32" or sys.implementation.name != "cpython":
        return QuietHelper(
            None, f"only built for CPython on POSIX (this is {sys.implementation.name} on {sys.platform})"
        )
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return QuietHelper(None, "no C compiler found (set CC or install gcc/clang)")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        return QuietHelper(None, f"no Python.h in {include} (install the interpreter's development headers)")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    with open(_SOURCE, "rb") as f:
        key = f.read() + repr((_FLAGS, sys.version, suffix, include)).encode()
    target = os.path.join(cache_dir(), f"v4quiet-{hashlib.sha256(key).hexdigest()[:16]}{suffix}")
    with build_cache.loading(target) as present:  # held against another process's pruning
        if present:
            return _import(target)
    if not os.path.exists(target):
        try:
            os.makedirs(cache_dir(), exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=suffix, dir=cache_dir())
            os.close(fd)
            try:
                subprocess.run(
                    [compiler, *_FLAGS, f"-I{include}", "-o", tmp, _SOURCE],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                os.replace(tmp, target)  # atomic: a concurrent builder never sees half a file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            return QuietHelper(None, f"building {_SOURCE} with {compiler} failed: {detail.strip()[:300]}")
        build_cache.prune(cache_dir(), f"v4quiet-*{suffix}")  # other versions' builds (source, flags, interpreter)
    with build_cache.loading(target):
        return _import(target)


def _import(target: str) -> QuietHelper:
    try:
        # the module's name must match its init function (PyInit__quiet); the file name need not
        loader = importlib.machinery.ExtensionFileLoader(f"{__package__}._quiet", target)
        spec = importlib.util.spec_from_file_location(f"{__package__}._quiet", target, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as exc:  # ImportError; or a warning raised as an error (a free-threaded build, -W error)
        return QuietHelper(None, f"loading {target} failed: {type(exc).__name__}: {exc}")
    return QuietHelper(module)
