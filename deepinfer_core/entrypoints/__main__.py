"""``python -m deepinfer_core.entrypoints``: the ``deepinfer`` command."""

from .main import console_main

console_main()
