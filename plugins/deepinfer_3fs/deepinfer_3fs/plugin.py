"""The 3fs plugin's hooks: a probe and the ``3fs`` KV store registration.

Entry point ``3fs = "deepinfer_3fs.plugin"`` in the group ``deepinfer``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from deepinfer_core import envs
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.platform import ProbeResult

from .store import MOUNT_ENV, USRBIO_MODULE, ThreeFSKVStore

DEEPINFER_CONTRACT = 2  # the deepinfer contract version this plugin is built for

IMPORT_CHECK_TIMEOUT_S = 30


def usrbio_importable() -> bool:
    """Whether ``hf3fs_fuse.io`` imports. The import runs in a subprocess (a native client
    that crashes on import must not take the host with it); when the package is not even on
    the path no subprocess is started."""
    if importlib.util.find_spec(USRBIO_MODULE.split(".")[0]) is None:
        return False
    try:
        done = subprocess.run(
            [sys.executable, "-c", f"import {USRBIO_MODULE}"],
            capture_output=True,
            timeout=IMPORT_CHECK_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def probe_mount(mount: str | None) -> ProbeResult:
    """Usable only with a configured, existing, writable directory as the mount."""
    if not mount:
        return ProbeResult(False, f"no 3FS mount configured (set {MOUNT_ENV})")
    if not os.path.exists(mount):
        return ProbeResult(False, f"3FS mount {mount} does not exist")
    if not os.path.isdir(mount):
        return ProbeResult(False, f"3FS mount {mount} is not a directory")
    if not os.access(mount, os.W_OK | os.X_OK):
        return ProbeResult(False, f"3FS mount {mount} is not writable")
    return ProbeResult(True, f"3FS mount {mount}")


@hookimpl
def deepinfer_probe() -> ProbeResult:
    result = probe_mount(envs.get(MOUNT_ENV))
    usrbio = (
        "USRBIO available" if usrbio_importable() else f"USRBIO unavailable ({USRBIO_MODULE} not importable; POSIX I/O)"
    )
    return ProbeResult(result.usable, f"{result.reason}; {usrbio}")


@hookimpl
def deepinfer_register_kv_stores(register) -> None:
    register("3fs", ThreeFSKVStore)
