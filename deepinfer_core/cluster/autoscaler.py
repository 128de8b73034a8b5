"""The autoscaler's policy: how many replicas a role should have now.

Demand is the role's own load: prefill scales on uncached prompt tokens waiting, decode on
running requests. Each decision, on a clock the caller passes (Ray Serve's control loop, the
simulator, a test)::

    wanted  = ceil(demand / target_per_replica) + spare          (the spare pool rides on top)
    wanted  = clamp(wanted, min_replicas, max_replicas)
    up      : wanted > current for up_delay_s in a row, and up_interval_s since the last step up;
              at most max_step_up replicas per step
    down    : wanted < current for down_delay_s in a row, down_interval_s since the last step
              down, at most max_step_down per step, and never while the load itself (wanted /
              max_replicas, the spare pool included) uses more than quota_hold (0.8) of the
              quota: capacity that is hard to get back is not given back under high load
              (DeepSeek's "no scale-down above 0.8 quota"). The rule reads the demand, not the
              replicas held: a fleet that grew past 0.8 of its quota at the peak still shrinks
              once the load falls below it.

A replica count outside the bounds (a config change) is put back inside at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Autoscaler", "ScaleDecision", "ScalingConfig"]


@dataclass(frozen=True)
class ScalingConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    target_per_replica: float = 1.0  # demand one replica should carry
    spare: int = 0  # replicas kept ready beyond demand
    up_delay_s: float = 10.0
    down_delay_s: float = 60.0
    up_interval_s: float = 10.0  # rate limits: at most one step up (down) per interval
    down_interval_s: float = 60.0
    max_step_up: int = 2
    max_step_down: int = 1
    quota_hold: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas, max >= 1; got {self.min_replicas}:{self.max_replicas}"
            )
        if self.target_per_replica <= 0:
            raise ValueError(f"target_per_replica must be > 0, got {self.target_per_replica}")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("max_step_up and max_step_down must be >= 1")


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    wanted: int
    reason: str


class Autoscaler:
    """One role's autoscaler; :meth:`decide` once per control-loop tick."""

    def __init__(self, config: ScalingConfig) -> None:
        self.config = config
        self._up_since: float | None = None  # when wanted first exceeded current (this run)
        self._down_since: float | None = None
        self._last_up = -math.inf
        self._last_down = -math.inf

    def wanted(self, demand: float) -> int:
        c = self.config
        need = math.ceil(max(0.0, demand) / c.target_per_replica) + c.spare
        return min(c.max_replicas, max(c.min_replicas, need))

    def decide(self, now: float, current: int, demand: float) -> ScaleDecision:
        c = self.config
        wanted = self.wanted(demand)
        if current < c.min_replicas or current > c.max_replicas:
            self._up_since = self._down_since = None
            return ScaleDecision(min(c.max_replicas, max(c.min_replicas, current)), wanted, "bounds")
        if wanted > current:
            self._down_since = None
            self._up_since = now if self._up_since is None else self._up_since
            if now - self._up_since < c.up_delay_s:
                return ScaleDecision(current, wanted, "up: waiting for the delay")
            if now - self._last_up < c.up_interval_s:
                return ScaleDecision(current, wanted, "up: rate limited")
            self._last_up = now
            return ScaleDecision(min(wanted, current + c.max_step_up), wanted, "up")
        if wanted < current:
            self._up_since = None
            if wanted / c.max_replicas > c.quota_hold:
                self._down_since = None
                return ScaleDecision(current, wanted, f"down: held, the load uses above {c.quota_hold} of the quota")
            self._down_since = now if self._down_since is None else self._down_since
            if now - self._down_since < c.down_delay_s:
                return ScaleDecision(current, wanted, "down: waiting for the delay")
            if now - self._last_down < c.down_interval_s:
                return ScaleDecision(current, wanted, "down: rate limited")
            self._last_down = now
            return ScaleDecision(max(wanted, current - c.max_step_down), wanted, "down")
        self._up_since = self._down_since = None
        return ScaleDecision(current, wanted, "steady")
