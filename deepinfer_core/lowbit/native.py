"""Build and load ``kernels.c`` (the AVX2 low-bit weight GEMMs), ``attention.c`` (decode attention
over the paged KV cache, float32 or half) and ``layer.c`` (a whole Llama decode step around them)
once per machine, through ctypes.

Why ctypes and not a torch C++ extension: the C files need no torch headers, so they compile with
any C compiler (one process per file, ~20 s of CPU in all) and need no ninja. Linked with ``-fopenmp``, it resolves
``libgomp.so.1`` to the runtime torch already loaded, so it shares torch's threads. The shared
object is cached under ``$XDG_CACHE_HOME/deepinfer`` (or ``~/.cache``) keyed by the hash of the
source and flags (builds of other versions pruned: ``deepinfer_core.build_cache``); a failed build is reported,
never raised: callers fall back to float weights.

Which instructions (:func:`isa_choice`): the kernels are written for AVX2 + FMA; where the running
CPU has AVX512-VNNI with AVX512-VL (Zen 4, Ice Lake and later Xeons) or AVX-VNNI, the library is
compiled with those flags too, and kernels_i16.c's int16 products take ``vpdpwssd`` (multiply,
pair-sum and accumulate in one instruction) where AVX2 needs ``vpmaddwd`` + ``vpaddd``: the same
integers, so every output keeps its bits (tests/test_lowbit_isa.py), fewer instructions.
``DEEPINFER_LOWBIT_ISA=avx2`` forces the AVX2 build (tests, A/B, debugging); ``avx512vnni`` or
``avxvnni`` force one on a CPU that has it; any other value, or one the CPU lacks, is refused.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from .. import build_cache, envs

_SOURCES = tuple(
    os.path.join(os.path.dirname(__file__), f)
    for f in (
        "kernels.c",
        "kernels_i16.c",
        "kernels_i8.c",
        "attention.c",
        "prefill_attention.c",
        "layer.c",
        "head.c",
        "head_screen.c",
    )
)  # one shared object
_HEADERS = (os.path.join(os.path.dirname(__file__), "vec.h"),)  # part of the cache key, not compiled alone
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
ISA_ENV = "DEEPINFER_LOWBIT_ISA"
# extra compiler flags per instruction set, and the /proc/cpuinfo flags each needs
_ISA_FLAGS = {
    "avx2": (),
    "avx512vnni": ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"),
    "avxvnni": ("-mavxvnni",),
}
_ISA_NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512vnni": ("avx512f", "avx512vl", "avx512bw", "avx512_vnni"),
    "avxvnni": ("avx_vnni",),
}


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library, or why there is none (``lib is None``)."""

    lib: ctypes.CDLL | None
    reason: str = ""
    isa: str = "avx2"  # the instruction set it was compiled for (_ISA_FLAGS)


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deepinfer")


def cpu_supports_kernels() -> tuple[bool, str]:
    """The kernels need AVX2 + FMA (every x86 CPU since 2013-2015); torch tells us what it saw."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512") or cap.startswith("AVX512"):
        return True, cap
    return False, f"CPU capability {cap} (the low-bit kernels need AVX2 and FMA)"


def compiler_path() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The running CPU's feature flags as Linux names them (empty where /proc/cpuinfo is not
    readable: then only the AVX2 build is chosen). torch's capability level does not say VNNI."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def isa_choice(environ: "os._Environ[str] | dict[str, str]" = os.environ, flags: frozenset[str] | None = None) -> str:
    """The instruction set the kernels are built for: ``DEEPINFER_LOWBIT_ISA`` (``auto``, the
    default: the best of avx512vnni, avxvnni, avx2 the CPU has), refused by name when unknown or
    when the CPU lacks it (the library would die of an illegal instruction)."""
    flags = cpu_flags() if flags is None else flags
    raw = envs.get(ISA_ENV, environ)  # auto or a name of _ISA_FLAGS
    if raw == "auto":
        return next((isa for isa in ("avx512vnni", "avxvnni") if all(f in flags for f in _ISA_NEEDS[isa])), "avx2")
    if raw != "avx2" and not all(f in flags for f in _ISA_NEEDS[raw]):
        raise ValueError(f"{ISA_ENV}={raw!r}: this CPU lacks {', '.join(f for f in _ISA_NEEDS[raw] if f not in flags)}")
    return raw


def describe_isa(isa: str) -> str:
    """For the start-up line and ``deepinfer plugins``."""
    return {"avx2": "AVX2 (vpmaddwd)", "avx512vnni": "AVX512-VNNI (vpdpwssd)", "avxvnni": "AVX-VNNI (vpdpwssd)"}[isa]


def load() -> NativeKernels:
    """Compile (first time) and load the kernels for :func:`isa_choice`; cached for the process
    (per instruction set). A VNNI build that fails falls back to the AVX2 one."""
    isa = isa_choice()
    kernels = load_isa(isa)
    if kernels.lib is None and isa != "avx2":
        kernels = load_isa("avx2")
    return kernels


@functools.cache
def load_isa(isa: str) -> NativeKernels:
    """The library built for ``isa`` (a key of _ISA_FLAGS; the caller checked the CPU has it)."""
    ok, why = cpu_supports_kernels()
    if not ok:
        return NativeKernels(None, why, isa)
    compiler = compiler_path()
    if compiler is None:
        return NativeKernels(None, "no C compiler found (set CC or install gcc/clang)", isa)
    flags = _FLAGS + _ISA_FLAGS[isa]
    source = b"".join(pathlib.Path(path).read_bytes() for path in _SOURCES + _HEADERS)
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = os.path.join(cache_dir(), f"lowbit-{digest}.so")
    with build_cache.loading(target) as present:  # held against another process's pruning
        if present:
            return _open(target, isa)
    if not os.path.exists(target):
        try:
            os.makedirs(cache_dir(), exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
            os.close(fd)
            try:
                started = time.monotonic()  # the first run's wait, said on stderr (once per machine)
                _say(f"building the low-bit CPU kernels ({isa}) once for this machine (about a minute)...")
                _build(compiler, flags, tmp)
                _say(f"built the low-bit CPU kernels in {time.monotonic() - started:.1f} s, cached in {cache_dir()}")
                os.replace(tmp, target)  # atomic: concurrent builders never see a half-written file
            finally:
                if os.path.exists(tmp):  # a failed build leaves nothing behind
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            return NativeKernels(
                None, f"building the low-bit kernels ({isa}) with {compiler} failed: {detail.strip()[:300]}", isa
            )
        build_cache.prune(cache_dir(), "lowbit-*.so")  # other source versions' builds, least recently used first
    with build_cache.loading(target):
        return _open(target, isa)


def _say(message: str) -> None:
    """One line on stderr, for the first run's kernel build (a minute of silence otherwise)."""
    print(f"deepinfer: {message}", file=sys.stderr, flush=True)


BUILD_TIMEOUT_S = 900  # a whole build; ~20 s on an idle 2-core machine, minutes under heavy load


def _build(compiler: str, flags: tuple[str, ...], output: str) -> None:
    """Compile every source to an object file, as many at once as there are cores (each file is
    its own translation unit either way, so the code is the same as one compiler call over all of
    them), then link ``output``. Raises OSError / SubprocessError with the compiler's message."""
    import concurrent.futures

    deadline = time.monotonic() + BUILD_TIMEOUT_S
    compile_flags = tuple(f for f in flags if f != "-shared")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(output)) as objects:

        def compile_one(index_source: tuple[int, str]) -> str:
            index, source = index_source
            obj = os.path.join(objects, f"{index}.o")
            subprocess.run(
                [compiler, *compile_flags, "-c", "-o", obj, source],
                check=True,
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
            )
            return obj

        workers = max(1, min(len(_SOURCES), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            built = list(pool.map(compile_one, enumerate(_SOURCES)))
        subprocess.run(
            [compiler, *flags, "-o", output, *built],
            check=True,
            capture_output=True,
            text=True,
            timeout=max(1.0, deadline - time.monotonic()),
        )


def _open(target: str, isa: str) -> NativeKernels:
    try:
        lib = ctypes.CDLL(target)  # RTLD_LOCAL: two builds in one process each call their own functions
    except OSError as exc:
        return NativeKernels(None, f"loading {target} failed: {exc}", isa)
    _declare(lib)
    return NativeKernels(lib, "", isa)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.lowbit_isa.argtypes = []
    lib.lowbit_isa.restype = i32
    lib.gemm_f32_act.argtypes = [p, i64, i64, i32, p, p, p, i64, p, i32]
    lib.gemm_f32_act.restype = None
    lib.gemm_i16_act.argtypes = [p, i64, i64, i32, p, p, p, i64, p, i32]
    lib.gemm_i16_act.restype = None
    lib.quantize_act16.argtypes = [p, i64, i64, p, p, p]
    lib.quantize_act16.restype = None
    if hasattr(
        lib, "gemm_i16_pre"
    ):  # absent from libraries built from sources before 2026-12-02 (benchmarks' A/B of old revisions)
        lib.gemm_i16_pre.argtypes = [p, p, p, i64, i64, i32, p, p, p, i64, p, i32]
        lib.gemm_i16_pre.restype = None
    lib.gemm_i8_act.argtypes = [p, i64, i64, p, p, p, i64, p, i32]
    lib.gemm_i8_act.restype = None
    lib.quantize_act8.argtypes = [p, i64, i64, p, p, p]
    lib.quantize_act8.restype = None
    lib.paged_decode_attention.argtypes = [
        p,
        p,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        p,
        i64,
        p,
        i64,
        ctypes.c_float,
        i64,
        p,
        i32,
        i32,
    ]
    lib.paged_decode_attention.restype = None
    lib.paged_write_kv.argtypes = [p, p, p, i64, i64, i64, i64, i64, i64, p, i64, i32]
    lib.paged_write_kv.restype = None
    lib.prefill_has_runs.argtypes = [p, p, i64, i64]
    lib.prefill_has_runs.restype = i64
    lib.prefill_attention.argtypes = [
        p,
        p,
        i64,
        p,
        i64,
        p,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        p,
        i64,
        p,
        i64,
        ctypes.c_float,
        i64,
        p,
        i32,
        i32,
        i32,
    ]
    lib.prefill_attention.restype = None
    lib.llama_decode_scratch_per_row.argtypes = [p]
    lib.llama_decode_scratch_per_row.restype = i64
    lib.llama_decode_step.argtypes = [p, p, p, p, p, p, i64, i64, p, p, i32, p]
    lib.llama_decode_step.restype = None
    lib.lowbit_head_argmax.argtypes = [p, i64, i64, i32, p, p, p, i64, i64, i64, i32, p]
    lib.lowbit_head_argmax.restype = i32
    if hasattr(lib, "lowbit_head_screen_argmax"):  # head_screen.c (absent from builds of older sources)
        lib.head_screen_panel_bytes.argtypes = [i64, i64]
        lib.head_screen_panel_bytes.restype = i64
        lib.head_screen_prepare.argtypes = [p, p, i64, i64, p, p]
        lib.head_screen_prepare.restype = i32
        lib.lowbit_head_screen_argmax.argtypes = [
            p,
            i64,
            i64,
            i32,
            p,
            p,
            p,
            i64,
            i64,
            i64,
            i32,
            p,
            ctypes.c_float,
            p,
            p,
        ]
        lib.lowbit_head_screen_argmax.restype = i32
