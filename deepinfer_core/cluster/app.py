"""Assemble the Ray Serve application: the board, the replica deployments, the ingress.

::

    "ingress"  ClusterIngress    1 replica; HTTP on Serve's proxy (--host / --port)
    "prefill"  EngineReplica     role prefill, N replicas or autoscaled   } ClusterRequestRouter
    "decode"   EngineReplica     role decode (or "both" when --prefill 0)  } ClusterScalingPolicy

Each engine deployment gets its own request router (the role's policy) and, with
``autoscale``, the role's autoscaling policy over the metrics its replicas record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ClusterSpec", "app_builder", "build_application", "BOARD_NAME"]

BOARD_NAME = "deepinfer-cluster-board"


@dataclass(frozen=True)
class ClusterSpec:
    model: str
    served_name: str
    engine_kwargs: dict
    prefill: int = 0
    decode: int = 1
    autoscale: dict = field(default_factory=dict)  # role -> (min, max)
    router: dict = field(default_factory=dict)  # RouterConfig fields
    prefill_target_tokens: float = 16384.0  # uncached prompt tokens waiting per prefill replica
    decode_target_requests: float = 32.0  # running requests per decode replica
    max_queue: int = 64
    replica_cpus: float = 0.0
    replica_gpus: float = 0.0
    routing_stats_period_s: float = 0.5
    sampling_defaults: str = "model"
    prefill_timeout_s: float = 60.0  # then decode computes the prompt itself
    drain_timeout_s: float = 60.0  # a replica scaled down finishes its requests for this long, then they move
    kv_lease_s: float = 60.0  # prefill holds the blocks it hands decode this long in the store (past retention)

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need --prefill >= 0 and --decode >= 1, got {self.prefill} and {self.decode}")
        if self.prefill and not self.engine_kwargs.get("kv_store"):
            raise ValueError("prefill replicas hand their blocks to decode through a shared KV store: give --kv-store")
        for role, (lo, hi) in self.autoscale.items():
            if role not in ("prefill", "decode"):
                raise ValueError(f"--autoscale: unknown role {role!r} (prefill or decode)")
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(f"--autoscale {role}: need 0 <= min <= max and max >= 1, got {lo}:{hi}")
        if not self.drain_timeout_s > 0:
            raise ValueError(f"--drain-timeout must be > 0 seconds, got {self.drain_timeout_s}")
        if not 0 < self.kv_lease_s < float("inf"):
            raise ValueError(f"--kv-lease must be > 0 seconds, got {self.kv_lease_s}")


def _engine_deployment(spec: ClusterSpec, role: str, count: int):
    from ray import serve
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    from .ray_glue import ClusterRequestRouter, ClusterScalingPolicy
    from .replica import EngineReplica

    options: dict = {
        "name": "engine" if role == "both" else role,
        "ray_actor_options": {"num_cpus": spec.replica_cpus, "num_gpus": spec.replica_gpus},
        "max_ongoing_requests": spec.engine_kwargs.get("max_num_seqs", 64) + spec.max_queue + 8,
        "request_router_config": RequestRouterConfig(
            request_router_class=ClusterRequestRouter,
            request_router_kwargs={"role": role, "board": BOARD_NAME, **spec.router},
            request_routing_stats_period_s=spec.routing_stats_period_s,
        ),
        "health_check_period_s": 5.0,
        # a replica scaled down (or redeployed) stops taking requests and finishes its running ones
        # for this long; then Serve stops it and the ingress continues each unfinished stream on
        # another replica, which loads the request's blocks (written as they filled) from the store
        "graceful_shutdown_timeout_s": spec.drain_timeout_s,
    }
    key = "prefill" if role == "prefill" else "decode"
    if key in spec.autoscale:
        lo, hi = spec.autoscale[key]
        target = spec.prefill_target_tokens if role == "prefill" else spec.decode_target_requests
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=lo, max_replicas=hi, initial_replicas=min(hi, max(lo, count)),
            upscale_delay_s=0, downscale_delay_s=0, metrics_interval_s=1.0, look_back_period_s=5.0,
            policy=AutoscalingPolicy(
                policy_function=ClusterScalingPolicy,
                policy_kwargs={"role": role, "min_replicas": lo, "max_replicas": hi, "target_per_replica": target},
            ),
        )  # fmt: skip
    else:
        options["num_replicas"] = count
    return serve.deployment(EngineReplica).options(**options)


def build_application(spec: ClusterSpec):
    """The bound Ray Serve application (``serve.run`` it). Creates the cluster board actor."""
    import ray
    from ray import serve

    from .board import BOARD_NAMESPACE, ClusterBoard
    from .ingress import ClusterIngress

    board = (
        ray.remote(ClusterBoard)
        .options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True, num_cpus=0, lifetime="detached")
        .remote()
    )
    ray.get(board.view.remote())  # up before any replica looks it up
    decode_role = "decode" if spec.prefill else "both"
    decode = _engine_deployment(spec, decode_role, spec.decode).bind(
        decode_role, spec.model, spec.engine_kwargs, spec.served_name, BOARD_NAME, spec.max_queue
    )
    prefill = None
    if spec.prefill or "prefill" in spec.autoscale:
        prefill = _engine_deployment(spec, "prefill", spec.prefill).bind(
            "prefill", spec.model, spec.engine_kwargs, spec.served_name, BOARD_NAME, spec.max_queue
        )
    ingress = serve.deployment(serve.ingress()(ClusterIngress)).options(
        name="ingress", ray_actor_options={"num_cpus": 0}
    )
    server_config = {
        "model_name": spec.served_name, "max_queue": spec.max_queue, "sampling_defaults": spec.sampling_defaults,
    }  # fmt: skip
    max_num_seqs = spec.engine_kwargs.get("max_num_seqs") or 64
    return ingress.bind(
        decode, prefill, spec.model, server_config, BOARD_NAME, max_num_seqs, spec.prefill_timeout_s, spec.kv_lease_s
    )


def app_builder(args: dict):
    """The application for Ray Serve's config files (``serve deploy``, KubeRay's RayService)::

        applications:
          - name: deepinfer
            route_prefix: /
            import_path: deepinfer_core.cluster.app:app_builder
            args: {model: smollm2-135m-instruct, served_name: smol, decode: 2,
                   engine_kwargs: {kv_store: "local:///srv/kv"}}
            deployments: [{name: decode, num_replicas: 3}]   # optional overrides

    ``args`` are :class:`ClusterSpec`'s fields. Unlike ``serve.run`` (each call a new code
    version: every replica restarts, the ingress and its open streams too), a config update that
    changes only a deployment's options keeps the code version: changing a role's
    ``num_replicas`` scales that role alone, and a replica scaled away drains, then its streams
    continue on the others."""
    fields = dict(args)
    if "autoscale" in fields:
        fields["autoscale"] = {role: tuple(bounds) for role, bounds in fields["autoscale"].items()}
    known = set(ClusterSpec.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"app_builder: unknown argument(s) {', '.join(unknown)}; the fields are {', '.join(sorted(known))}"
        )
    return build_application(ClusterSpec(**fields))
