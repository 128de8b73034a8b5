"""deepinfer-3fs: a persistent KV cache shared across instances through a 3FS mount."""

from __future__ import annotations

from .store import MOUNT_ENV, ThreeFSConfigError, ThreeFSKVStore

__all__ = ["MOUNT_ENV", "ThreeFSConfigError", "ThreeFSKVStore"]
