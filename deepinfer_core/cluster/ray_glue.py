"""The policies inside Ray Serve: a custom request router and a custom autoscaling policy.

:class:`ClusterRequestRouter` is a ``ray.serve.request_router.RequestRouter``: Ray calls
``choose_replicas`` with the candidate replicas (each carrying the ``routing_stats`` its replica
last returned from ``record_routing_stats``) and the pending request, whose first argument is
the :class:`~.jobs.Job`; the pure policy in :mod:`.router` picks. :class:`ClusterScalingPolicy`
is a class-style custom autoscaling policy: Ray instantiates it once with ``policy_kwargs`` and
calls it every control-loop tick with an ``AutoscalingContext`` whose aggregated metrics are the
replicas' ``record_autoscaling_stats``.
"""

from __future__ import annotations

import logging
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .autoscaler import Autoscaler, ScalingConfig
from .board import BOARD_NAMESPACE
from .router import PrefixIndex, ReplicaLoad, RoutedLedger, RouterConfig, route_decode, route_prefill

__all__ = ["ClusterRequestRouter", "ClusterScalingPolicy", "DEMAND_METRIC"]

log = logging.getLogger(__name__)
DEMAND_METRIC = {"prefill": "waiting_prompt_tokens", "decode": "running_requests", "both": "running_requests"}


def replica_load(replica: RunningReplica) -> ReplicaLoad:
    """Its published load; not its block digests (the router's :class:`PrefixIndex` holds those)."""
    stats = replica.routing_stats or {}
    return ReplicaLoad(
        name=replica.replica_id.unique_id,
        role=stats.get("role", "both"),
        running=stats.get("running", 0),
        waiting=stats.get("waiting", 0),
        waiting_tokens=stats.get("waiting_tokens", 0),
        resident_blocks=stats.get("resident_blocks", 0),
        num_blocks=stats.get("num_blocks", 1),
    )


class ClusterRequestRouter(RequestRouter):
    """``request_router_kwargs``: ``role`` ("prefill" | "decode" | "both"), ``board`` (the cluster
    board actor's name, or None) and RouterConfig's fields."""

    def initialize_state(self, role: str = "decode", board: str | None = None, **config) -> None:
        if "tier_bounds" in config:
            config["tier_bounds"] = tuple(config["tier_bounds"])
        self.role = role
        self.config = RouterConfig(**config)
        self.board_name = board
        self._board = None
        self._ledger = RoutedLedger()  # jobs sent that the replicas' published loads may not show yet
        self._index = PrefixIndex()  # every replica's published digests, updated when it publishes
        self._seen: dict[str, tuple] = {}  # replica -> (its publication's stamp, when last a candidate)

    FORGET_S = 60.0  # a replica absent from the candidates this long leaves the index

    def _refresh_index(self, candidates: list[RunningReplica], now: float) -> None:
        for r in candidates:
            name, stats = r.replica_id.unique_id, r.routing_stats or {}
            keys = stats.get("prefix_keys", ())
            stamp = (stats.get("at"), len(keys), id(keys))
            if name not in self._seen or self._seen[name][0] != stamp:
                self._index.publish(name, keys)
            self._seen[name] = (stamp, now)
        for name, (_, last) in list(self._seen.items()):
            if now - last > self.FORGET_S:
                self._index.drop(name)
                del self._seen[name]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        job = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if job is None or not hasattr(job, "block_keys") or not candidate_replicas:
            return [candidate_replicas]
        now = time.time()
        prefill = job.role == "prefill" or self.role == "both"  # colocated replicas prefill themselves
        if prefill:
            self._refresh_index(candidate_replicas, now)
        loads = [
            self._ledger.adjust(replica_load(r), (r.routing_stats or {}).get("at"), now) for r in candidate_replicas
        ]
        n = len(job.prompt_token_ids)
        if prefill:
            decision = route_prefill(job.block_keys, n, loads, self.config, self._index)
        else:
            decision = route_decode(n, job.max_tokens, loads, self.config)
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == decision.replica]
        blocks = -(-(n + job.max_tokens) // self.config.block_size)
        self._ledger.record(decision.replica, now, n - decision.cached_tokens, blocks)
        self._post(job, decision)
        rest = [r for r in candidate_replicas if r.replica_id.unique_id != decision.replica]
        return [chosen, rest] if rest else [chosen]

    def _post(self, job, decision) -> None:
        if self.board_name is None:
            return
        try:
            if self._board is None:
                import ray

                self._board = ray.get_actor(self.board_name, namespace=BOARD_NAMESPACE)
            record = {
                "request": job.request_id, "stage": job.role, "replica": f"{self.role}-{decision.replica}",
                "reason": decision.reason, "prompt_tokens": len(job.prompt_token_ids),
            }  # fmt: skip
            if decision.tier is not None:
                record.update(tier=decision.tier, cached_tokens=decision.cached_tokens)
            self._board.decide.remote(record)
        except Exception:  # the board is for people; routing goes on without it
            log.debug("posting a router decision failed", exc_info=True)


class ClusterScalingPolicy:
    """``policy_kwargs``: ``role`` and ScalingConfig's fields (its bounds are the deployment's)."""

    def __init__(self, role: str = "decode", **config) -> None:
        self.role = role
        self.metric = DEMAND_METRIC[role]
        self.autoscaler = Autoscaler(ScalingConfig(**config))
        self.last = None

    def __call__(self, ctx) -> tuple[int, dict]:
        per_replica = (ctx.aggregated_metrics or {}).get(self.metric, {})
        demand = float(sum(per_replica.values()))
        now = ctx.current_time if ctx.current_time is not None else time.time()
        self.last = self.autoscaler.decide(now, ctx.current_num_replicas, demand)
        if self.last.replicas != ctx.current_num_replicas:
            log.info(
                "%s: %d -> %d replicas (%s; demand %.0f)",
                self.role,
                ctx.current_num_replicas,
                self.last.replicas,
                self.last.reason,
                demand,
            )
        return self.last.replicas, ctx.policy_state
