"""``deepinfer cluster``: the serving cluster on Ray Serve (deepinfer_core/cluster/).

Same HTTP API as ``deepinfer serve`` at one address, in front of prefill and decode replicas
(or colocated replicas with ``--prefill 0``). Without ``--address`` Ray starts a local cluster
in this process; with one it joins a running cluster (``ray start --head`` / KubeRay). The
command runs until SIGINT / SIGTERM, then shuts the application down. ``--config FILE.yaml``
gives the same options from a file (:mod:`.config_file`); flags on the command line win.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ..engine.config import engine_options
from .config_file import parse_over_file
from .engine_options import add_engine_options, add_model_option, engine_kwargs
from .serve import _port

__all__ = ["add_parser", "options_with_config", "parse_autoscale", "run", "spec_from_args"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cluster",
        help="serve a model from many replicas on Ray Serve (prefill/decode through the KV store)",
        description="Serve a model from prefill and decode replicas on Ray Serve, behind the same HTTP API as "
        "`deepinfer serve` plus GET /cluster. Prefill replicas write the prompt's KV blocks to the shared store "
        "(--kv-store), decode replicas read them. Needs `pip install 'deepinfer-core[cluster]'`.",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help="the options below from a YAML file (long names as keys: `decode: 2`, `kv_store: local:///tmp/kv`, "
        "`autoscale: {decode: '1:4'}`); flags given here win",
    )
    add_model_option(p)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--prefill", type=int, default=0, help="prefill replicas; 0: colocated (default: %(default)s)")
    p.add_argument("--decode", type=int, default=1, help="decode (or colocated) replicas (default: %(default)s)")
    p.add_argument("--address", default=None, help="a running Ray cluster to join (default: start a local one)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="HTTP port (default: %(default)s)")
    p.add_argument(
        "--autoscale",
        action="append",
        default=[],
        metavar="[ROLE=]MIN:MAX",
        help="autoscale a role (prefill, decode; no role: both) between MIN and MAX replicas; repeatable",
    )
    p.add_argument(
        "--tier-bounds",
        default=None,
        metavar="A,B,C",
        help="uncached prompt tokens where the prefill tiers split (default: 16384,65536,262144)",
    )
    p.add_argument(
        "--prefill-target",
        type=float,
        default=16384.0,
        help="uncached prompt tokens waiting per prefill replica the autoscaler aims at (default: %(default)s)",
    )
    p.add_argument(
        "--decode-target",
        type=float,
        default=32.0,
        help="running requests per decode replica the autoscaler aims at (default: %(default)s)",
    )
    p.add_argument(
        "--replica-cpus", type=float, default=0.0, help="Ray CPUs each replica reserves (default: %(default)s)"
    )
    p.add_argument(
        "--replica-gpus", type=float, default=0.0, help="Ray GPUs each replica reserves (default: %(default)s)"
    )
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests each replica queues beyond its batch (default: %(default)s)"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds a replica being scaled down may finish its running requests; the rest then continue "
        "on other replicas from the KV store (default: %(default)s)",
    )
    p.add_argument(
        "--kv-lease",
        type=float,
        default=60.0,
        help="seconds a prefill replica holds the blocks it hands a decode replica in the KV store, past "
        "their retention if need be; decode releases them once loaded, and recomputes what a lease "
        "that ran out lost (default: %(default)s)",
    )
    add_engine_options(p)
    p.set_defaults(func=run)
    return p


def parse_autoscale(values: list[str], prefill: int) -> dict:
    """``["decode=1:4", "0:2"]`` -> {role: (min, max)}; a value without a role applies to both
    roles (prefill only where there are prefill replicas)."""
    out: dict = {}
    for value in values:
        role, _, bounds = value.rpartition("=")
        lo, sep, hi = bounds.partition(":")
        try:
            pair = (int(lo), int(hi))
        except ValueError:
            raise ValueError(f"--autoscale: expected [ROLE=]MIN:MAX, got {value!r}") from None
        if not sep:
            raise ValueError(f"--autoscale: expected [ROLE=]MIN:MAX, got {value!r}")
        for r in [role] if role else (["prefill", "decode"] if prefill else ["decode"]):
            out[r] = pair
    return out


def options_with_config(args: argparse.Namespace, argv: list[str]) -> argparse.Namespace:
    """``args`` (the command line ``argv``, the words after ``cluster``, parsed) with the options
    of its ``--config`` file under those the command line gives."""
    if args.config is None:
        return args

    def make_parser(parser_class: type) -> argparse.ArgumentParser:
        return add_parser(argparse.ArgumentParser().add_subparsers(parser_class=parser_class))

    switches = frozenset(f.name for f in engine_options() if f.type in ("bool", "bool | None"))
    return parse_over_file(
        make_parser, argv, args.config,
        switches=switches, repeatable=frozenset({"autoscale"}), not_options=frozenset({"config", "func"}),
    )  # fmt: skip


def spec_from_args(args: argparse.Namespace):
    from ..cluster.app import ClusterSpec

    router = {}
    if args.tier_bounds:
        try:
            router["tier_bounds"] = [int(x) for x in args.tier_bounds.split(",")]
        except ValueError:
            raise ValueError(f"--tier-bounds: expected whole numbers A,B,C, got {args.tier_bounds!r}") from None
    kwargs = engine_kwargs(args)
    if kwargs.get("block_size"):
        router["block_size"] = kwargs["block_size"]
    return ClusterSpec(
        model=args.model, served_name=args.served_model_name or args.model, engine_kwargs=kwargs,
        prefill=args.prefill, decode=args.decode, autoscale=parse_autoscale(args.autoscale, args.prefill),
        router=router, prefill_target_tokens=args.prefill_target, decode_target_requests=args.decode_target,
        max_queue=args.max_queue, replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
        drain_timeout_s=args.drain_timeout, kv_lease_s=args.kv_lease,
    )  # fmt: skip


def _fail(message: str) -> int:
    print(f"deepinfer cluster: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        args = options_with_config(args, args.argv[1:])
        spec = spec_from_args(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        import ray
        from ray import serve
    except ImportError:
        return _fail("the cluster runs on Ray Serve: pip install 'deepinfer-core[cluster]'")
    from ..cluster.app import build_application

    ray.init(address=args.address, include_dashboard=False if args.address is None else None)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(spec), name="deepinfer", route_prefix="/")
        print(f"deepinfer cluster: listening on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
