"""How long a full garbage collection stalls a `deepinfer serve` process, with and without the
`gc.freeze()` the server does once its engine is up (entrypoints/serve.py).

    .venv/bin/python benchmarks/serve/gc_pause.py [--model PATH] [--rounds 3]

Builds what `deepinfer serve` builds (the plugin host, the engine on the default model, the HTTP
app), then times `gc.collect()` (a full, generation-2 collection: what Python runs now and then
while requests allocate) `--rounds` times before the freeze and after it, in CPU ms, and prints the
objects the collector tracks either way. The engine's own step never calls the collector; an
automatic full collection lands in whichever request step allocates at that moment, so its length
is a tail-latency pause for every request in flight.
"""

from __future__ import annotations

import argparse
import gc
import time


def full_collection_ms(rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.process_time()
        gc.collect()
        out.append((time.process_time() - t) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from deepinfer_core.engine.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.entrypoints.serve import DEFAULT_MODEL
    from deepinfer_core.plugin_host import default_host
    from deepinfer_core.serve.app import Server, ServerConfig

    host = default_host()
    model = args.model or DEFAULT_MODEL
    engine = LLMEngine(EngineConfig(model=model), host)
    Server(engine, host, ServerConfig(model_name="bench"))
    before = full_collection_ms(args.rounds)
    tracked_before = len(gc.get_objects())
    gc.freeze()
    after = full_collection_ms(args.rounds)
    tracked_after = len(gc.get_objects())
    print(f"model: {model}")
    print("| gc.collect() (full) | objects tracked | CPU ms per collection (each round) | best |")
    print("|---|---:|---|---:|")
    print(f"| without gc.freeze | {tracked_before:,} | {', '.join(f'{x:.1f}' for x in before)} | {min(before):.1f} |")
    print(
        f"| after gc.freeze (serve) | {tracked_after:,} ({gc.get_freeze_count():,} frozen) | "
        f"{', '.join(f'{x:.1f}' for x in after)} | {min(after):.1f} |"
    )
    ratio = f"{min(before) / min(after):.0f}x" if min(after) >= 0.1 else f"{min(before):.1f} ms -> under 0.1 ms"
    print(f"| without / after | | | {ratio} |")


if __name__ == "__main__":
    main()
