"""The low-bit CPU backend as a builtin plugin (filled in by the next commits)."""
