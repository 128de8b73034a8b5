"""Triton kernels of the cuda_sm100 plugin. Importing this package imports Triton; the plugin's
hook module never does so at import time (``triton_available()`` decides first)."""
