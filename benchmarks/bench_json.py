"""The JSON a benchmark writes with ``--json PATH``: one file per run, read by ``benchmarks/report.py``.

    {"benchmark": "cpu_throughput", "script": "benchmarks/cpu/cpu_throughput.py", "command": "...",
     "machine": "...", "date": "2026-12-02 05:04 UTC", "commit": "bb50827", "peer": "llama.cpp ...",
     "rows": [{...}, ...], "notes": "..."}

``rows`` are the benchmark's own table rows (its keys are documented where the script writes them).
The files under ``benchmarks/results/`` are the figures of record that docs/performance.md quotes.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
    """``git describe --always --dirty`` of this checkout, or "unknown"."""
    git = ["git", "-C", REPO, "describe", "--always", "--dirty"]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip() or "unknown"


def machine(accelerator: str = "") -> str:
    """CPU model, core count and OS; ``accelerator`` (e.g. the GPU's name) first when given."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    host = f"{cpu} x {os.cpu_count()}, {platform.system()}, Python {platform.python_version()}"
    return f"{accelerator}; host {host}" if accelerator else host


def finite(value):
    """NaN and infinities (a measure that did not run) as None, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write(
    path: str, benchmark: str, rows: list[dict], peer: str, accelerator: str = "", notes: str = "", **extra
) -> None:
    """Write one run's result; the command is this process's own command line; ``extra`` keys are kept
    as they are (a script's raw measures)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    result = {
        "benchmark": benchmark,
        "script": script,
        "command": " ".join(["python", script, *sys.argv[1:]]),
        "machine": machine(accelerator),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "peer": peer,
        "rows": rows,
        "notes": notes,
        **extra,
    }
    with open(path, "w") as f:
        json.dump(finite(result), f, indent=1, default=str, allow_nan=False)
        f.write("\n")
