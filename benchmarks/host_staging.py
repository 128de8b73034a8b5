"""Host time of the batch build's one host-to-device copy: a fresh pinned buffer per step
(``pin_memory()``, as before deepinfer_core/staging.py) against the reused pinned staging buffers.

Why: the H200's cProfile of a 64 x 512 prefill put ``pin_memory()`` at ~4 ms of the 7 ms batch
build (benchmarks/README.md, hostpath). This times ``batch_build.build`` itself on an accelerator,
for that prefill (64 x 512 prompt tokens, block size 16) and a 256-request decode step (128-token
contexts), with the two copy paths alternated in one process (``--rounds`` rounds of ``--steps``
builds each; per build: CPU time of this thread and wall time, median over rounds). Before each
build the stream is kept busy (``torch.cuda._sleep`` where CUDA has it), so copies are still
pending when the next build starts, as under overlapped scheduling.

    python benchmarks/host_staging.py --rounds 7 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from deepinfer_core import staging
from deepinfer_core.engine import batch_build
from deepinfer_core.engine.scheduler import ScheduledRequest, SchedulerOutput


def fresh_pinned(arrays, device):
    """The copy as it was: concatenate, pin a fresh buffer, copy asynchronously."""
    return torch.from_numpy(np.concatenate(arrays)).pin_memory().to(device, non_blocking=True)


def prefill(n=64, length=512, bs=16) -> SchedulerOutput:
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(n):
        arr = rng.integers(2, 129_280, length).astype(np.uint32)
        blocks = tuple(range(i * (length // bs), (i + 1) * (length // bs)))
        reqs.append(ScheduledRequest(f"p{i}", tuple(arr.tolist()), 0, blocks, True, 0, length, arr))
    return SchedulerOutput(tuple(reqs), n * length)


def decode(n=256, ctx=128, bs=16) -> SchedulerOutput:
    per = ctx // bs + 1
    reqs = tuple(
        ScheduledRequest(f"d{i}", (7 + i,), ctx, tuple(range(i * per, (i + 1) * per)), True, 0, ctx) for i in range(n)
    )
    return SchedulerOutput(reqs, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default=None, help="default: the current accelerator")
    args = ap.parse_args()
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = torch.device(args.device) if args.device else acc
    if device is None or device.type == "cpu":
        raise SystemExit("needs an accelerator (CPU engines copy nothing)")
    busy = (lambda: torch.cuda._sleep(1_000_000)) if device.type == "cuda" else (lambda: None)  # ~0.5 ms of queued work
    staged = batch_build.arrays_to_device
    paths = {"fresh pin_memory": fresh_pinned, "staging": staged}
    print(
        f"device {torch.accelerator.current_accelerator()} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}, torch {torch.__version__}"
    )
    print(
        "| build, ms a step | fresh pin_memory CPU | staging CPU | CPU ratio | fresh wall | staging wall | wall ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, out in (("prefill 64 x 512", prefill()), ("decode 256 requests", decode())):
        cpu = {k: [] for k in paths}
        wall = {k: [] for k in paths}
        for r in range(args.rounds + 1):  # round 0 warms both paths (first pinned allocations)
            for key, fn in paths.items() if r % 2 else reversed(paths.items()):
                batch_build.arrays_to_device = fn
                torch.accelerator.synchronize()
                c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                for _ in range(args.steps):
                    busy()
                    batch_build.build(out, 16, device)
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                if r:
                    cpu[key].append((c1 - c0) / 1e6 / args.steps)
                    wall[key].append((w1 - w0) / 1e6 / args.steps)
        batch_build.arrays_to_device = staged
        c = {k: statistics.median(v) for k, v in cpu.items()}
        w = {k: statistics.median(v) for k, v in wall.items()}
        a, b = paths
        print(
            f"| {name} | {c[a]:.3f} | {c[b]:.3f} | {c[a] / c[b]:.2f}x | {w[a]:.3f} | {w[b]:.3f} | {w[a] / w[b]:.2f}x |"
        )
    torch.accelerator.synchronize()
    st = staging.staging_for(device)
    print(f"staging counters: {st.counters}")


if __name__ == "__main__":
    main()
