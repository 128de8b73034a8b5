"""The cluster's notice board: the last snapshot each replica published and the router's recent
decisions, read by ``GET /cluster`` and the aggregated ``/metrics``.

One instance runs as a named Ray actor (:mod:`.app` wraps it); replicas and routers post to it
without waiting for an answer. Nothing routes through it: the routers read Ray Serve's routing
stats, so a slow board never delays a request.
"""

from __future__ import annotations

import time
from collections import deque

__all__ = ["BOARD_NAMESPACE", "ClusterBoard"]

BOARD_NAMESPACE = "deepinfer"  # the Ray namespace of the board actor (Serve replicas run in "serve")

STALE_S = 30.0  # a replica silent this long is gone (killed, scaled down)


class ClusterBoard:
    def __init__(self, max_decisions: int = 50) -> None:
        self._replicas: dict[str, dict] = {}
        self._metrics: dict[str, str] = {}
        self._seen: dict[str, float] = {}
        self._decisions: deque = deque(maxlen=max_decisions)

    def publish(self, name: str, snapshot: dict, metrics_text: str = "") -> None:
        self._replicas[name] = snapshot
        self._metrics[name] = metrics_text
        self._seen[name] = time.monotonic()

    def decide(self, decision: dict) -> None:
        self._decisions.append({"time": round(time.time(), 3), **decision})

    def _live(self) -> list[str]:
        now = time.monotonic()
        for name in [n for n, t in self._seen.items() if now - t > STALE_S]:
            self._replicas.pop(name, None)
            self._metrics.pop(name, None)
            self._seen.pop(name, None)
        return sorted(self._replicas)

    def view(self) -> dict:
        names = self._live()
        return {"replicas": [self._replicas[n] for n in names], "router_decisions": list(self._decisions)[::-1]}

    def metrics(self) -> dict[str, str]:
        return {n: self._metrics[n] for n in self._live()}
