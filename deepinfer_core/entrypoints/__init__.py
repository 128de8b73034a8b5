"""Every ``deepinfer`` command: one module per command, registered in :mod:`.main`
(``deepinfer_core.entrypoints.main:console_main`` is the console script;
``python -m deepinfer_core.entrypoints`` runs the same)."""
