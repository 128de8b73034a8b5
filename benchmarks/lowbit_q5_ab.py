"""A GGUF's Q5_0/Q5_1/Q5_K weights served at 5 bits (q5) vs re-quantized to 8 bits (q8, the
path before 2026-12-01 22:00), in one process: bytes per step and the decode step's time.

    .venv/bin/python benchmarks/lowbit_q5_ab.py --requests 1,32 --steps 32 --threads 2

Two engines on the same file (default: cpu_throughput.py's SmolLM2 Q4_K_M, mostly Q5_0): "q5"
as deepinfer loads it now, "q8" with every q5 weight turned into what the loader made of it
before (formats.quantize_q8 of its dequantized values: gguf's own, tests/test_lowbit.py). Each
prefills the same ``--requests`` 128-token prompts, then their decode steps alternate, one step
of one engine, one of the other, so both see the same machine load. Per step: the process's CPU
ms and the wall ms of ``engine.step()`` (medians), and the packed bytes every step reads (all
layer weights and the head; the embedding rows are a lookup). Both engines keep ``--threads``
(DEEPINFER_ADAPTIVE_THREADS=0 unless set).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def packed_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of every packed weight (codes, scales, offsets) by kind; a tied head counted once."""
    from deepinfer_core.lowbit.modules import LowBitEmbedding, LowBitLinear

    out: dict[str, int] = {}
    for module in model.modules():
        weights = (
            module.segments
            if isinstance(module, LowBitLinear)
            else [module.weight_q]
            if isinstance(module, LowBitEmbedding)
            else []
        )
        for w in weights:
            n = sum(t.numel() * t.element_size() for t in (w.qs, w.d, w.m) if t is not None)
            out[w.kind] = out.get(w.kind, 0) + n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gguf", default="Q4_K_M", help="a type cpu_throughput.py writes (Q4_K_M, Q5_0, ...) or a path"
    )
    parser.add_argument("--requests", default="1,32")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    from cpu_throughput import build_prompts, make_gguf, start_decoding
    from lowbit_agreement import q5_as_q8

    from deepinfer_core import LLM, SamplingParams

    path = args.gguf if os.path.exists(args.gguf) else make_gguf(args.gguf)
    torch.set_num_threads(args.threads)
    os.environ.setdefault(
        "DEEPINFER_ADAPTIVE_THREADS", "0"
    )  # both engines on --threads (the chooser's probes differ per engine)
    print(
        f"{os.path.basename(path)}, {args.threads} threads, {args.steps} decode steps per engine, alternating; "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| requests | weights | MB read per step | step CPU ms (median) | step wall ms (median) |\n|---:|---|---:|---:|---:|"
    )
    for requests in (int(r) for r in args.requests.split(",")):
        prompts = build_prompts(requests, 128)
        params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
        engines, sizes = {}, {}

        def build():
            return LLM(path, device="cpu", max_num_seqs=requests, kv_cache_blocks=2 * requests + 2)

        for name in ("q8", "q5"):
            llm = q5_as_q8(build) if name == "q8" else build()  # q8: the loader before q5
            sizes[name] = packed_bytes(llm.engine.model)
            engines[name] = start_decoding(llm, prompts, params, name)
        cpu, wall = {n: [] for n in engines}, {n: [] for n in engines}
        for _ in range(args.steps):
            for name, engine in engines.items():
                t0, c0 = time.perf_counter(), time.process_time()
                engine.step()
                cpu[name].append((time.process_time() - c0) * 1e3)
                wall[name].append((time.perf_counter() - t0) * 1e3)
        for name in engines:
            kinds = " + ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(sizes[name].items()))
            print(
                f"| {requests} | {name} ({kinds}) | {sum(sizes[name].values()) / 1e6:.1f} | {statistics.median(cpu[name]):.2f} | "
                f"{statistics.median(wall[name]):.2f} |"
            )
        c = statistics.median(cpu["q8"]) / statistics.median(cpu["q5"])
        w = statistics.median(wall["q8"]) / statistics.median(wall["q5"])
        print(
            f"| {requests} | q8 / q5 | {sum(sizes['q8'].values()) / sum(sizes['q5'].values()):.2f}x | {c:.2f}x | {w:.2f}x |"
        )
        del engines


if __name__ == "__main__":
    main()
