"""Lowering this plugin's Triton kernels to machine code for a named GPU, with no GPU present.

CI has no GPU and runs the kernels in Triton's interpreter, which accepts code that the compiler
rejects (branches yielding different types, narrow ``tl.dot`` tiles, launches that overflow an
H200's shared memory). Triton's ahead-of-time compile for an explicit target (SM90, SM100) needs
no GPU, so the plugin's tests use it to prove the kernels lower. It must run in a process where
the interpreter is off (``TRITON_INTERPRET`` replaces the compiler): :func:`run_script`.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

UNSUPPORTED = "this Triton's ahead-of-time API predates ASTSource(constexprs=...) (Triton >= 3.3 has it)"


def supported() -> bool:
    """Whether this Triton's ahead-of-time API takes ``ASTSource(constexprs=...)`` (Triton >= 3.3)."""
    from triton.compiler import ASTSource

    return "constexprs" in inspect.signature(ASTSource.__init__).parameters


def lower(fn, types: dict[str, str], consts: dict, arch: int, warps: int, stages: int | None = None):
    """Compile the Triton kernel ``fn`` for ``sm_<arch>`` and return the compiled kernel (its
    ``metadata.shared`` is the shared memory a launch needs). ``types``: the Triton type of each
    runtime argument (``"*bf16"``, ``"fp32"``, ...; unnamed ones are ``i32``); ``consts``: the
    constexpr arguments' values (those with a default may be left out). Raises when no cubin
    comes out."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # a constexpr the caller leaves out takes its default, as a launch does (left a runtime i32,
    # its ``if`` branches would have to agree in type and the kernel would not compile)
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    options = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    if not kernel.asm.get("cubin"):
        raise RuntimeError(f"{fn.__name__} produced no cubin for sm_{arch}")
    return kernel


def run_script(script: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``script`` (Python source that calls :func:`lower`) in a fresh interpreter with
    ``TRITON_INTERPRET`` unset; returns the finished process (stdout, stderr, returncode)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
