"""One run of cpu_throughput.py's deepinfer measurement (32 prompts of 128 tokens, 128 new tokens,
2 threads, after the same 2-token warm-up), in this process, with every native call logged: prefill
vs decode wall time, the thread count each decode step ran on, the chooser's probes and switches
(it wraps ``LlamaDecodePlan._call``). Prints one JSON line. Run it in a fresh process per
reading, several times, to see what separates a slow run from a fast one (benchmarks/README.md,
cpuvar)::

    for i in 1 2 3 4 5 6; do python benchmarks/cpu_step_log.py; done
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_throughput  # noqa: E402

from deepinfer_core.lowbit import llama_decode  # noqa: E402

LOG: list[dict] = []
_call = llama_decode.LlamaDecodePlan._call


def logged_call(self, ids, positions, slots, tables, out, decode):
    chooser, start = self.threads, time.perf_counter()
    switches = chooser.switches if chooser else 0
    _call(self, ids, positions, slots, tables, out, decode)
    LOG.append(
        {
            "decode": decode,
            "rows": ids.shape[0],
            "wall": (time.perf_counter() - start) * 1e3,
            "probe": chooser is not None and decode and chooser._probing is not None,
            "threads": chooser.current if chooser else None,
            "switched": chooser.switches - switches if chooser else 0,
        }
    )


def main() -> None:
    llama_decode.LlamaDecodePlan._call = logged_call
    n, new_tokens, threads = 32, 128, int(os.environ.get("THREADS", "2"))
    prompts = cpu_throughput.build_prompts(n, 128)
    generate = cpu_throughput.load_deepinfer(prompts, new_tokens, threads)
    generate([p[::-1] for p in prompts], 2)
    LOG.clear()
    start, cpu = time.perf_counter(), time.process_time()
    outputs = generate(prompts, new_tokens)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    decode, prefill = [e for e in LOG if e["decode"]], [e for e in LOG if not e["decode"]]
    print(
        json.dumps(
            {
                "tok_s": round(n * new_tokens / seconds, 1),
                "seconds": round(seconds, 3),
                "cpu_s": round(cpu, 2),
                "prefill_ms": round(sum(e["wall"] for e in prefill)),
                "prefill_calls": len(prefill),
                "decode_ms": round(sum(e["wall"] for e in decode)),
                "decode_steps": len(decode),
                "decode_median_ms": round(statistics.median(e["wall"] for e in decode), 1),
                "outside_calls_ms": round(seconds * 1e3 - sum(e["wall"] for e in LOG)),
                "switches": sum(e["switched"] for e in decode),
                "probes": [[i, round(e["wall"], 1)] for i, e in enumerate(decode) if e["probe"]],
                "threads_per_step": "".join("p" if e["probe"] else str(e["threads"]) for e in decode),
                "first_tokens": outputs[0][:8],
            }
        )
    )


if __name__ == "__main__":
    main()
