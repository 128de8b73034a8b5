"""Timing a kernel benchmark's launches as the decode step runs them: captured in one CUDA graph.

Shared by benchmarks/kernels/bf16_gemv.py and benchmarks/kernels/fp8_gemv.py (run as scripts, this folder first on
``sys.path``)."""

from __future__ import annotations

import torch
import triton


def graph_ms(fn, device: str = "cuda") -> float:
    """Median replay of ``fn``'s launches captured in one graph; the eager warm-up runs on the
    capture stream (split counters are per stream, allocated outside a capture). On the CPU
    (a script's ``--dry``: Triton's interpreter, no graphs) ``fn`` runs once, untimed: NaN."""
    if device == "cpu":
        fn()
        return float("nan")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
