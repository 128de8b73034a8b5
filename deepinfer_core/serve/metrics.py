"""Prometheus metrics, named like vLLM's where the meaning is the same (``deepinfer:`` prefix).

One registry per server (no global state): latency histograms are observed in the step thread as
outputs arrive, the engine's cumulative counters (prefix-cache queries and hits, preemptions) are
mirrored after every step, 429s are counted by the HTTP layer. ``prometheus_client`` metrics are
thread safe.
"""

from __future__ import annotations

import time

from ..engine.outputs import RequestOutput
from .front import StepTiming

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = ("model_name",)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            metric = Counter(name, doc, labels + extra, registry=self.registry)
            return metric if extra else metric.labels(model_name)

        def gauge(name: str, doc: str):
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        self.model_name = model_name
        self.ttft = histogram(
            "deepinfer:time_to_first_token_seconds", "Time from arrival to the first generated token."
        )
        self.itl = histogram("deepinfer:inter_token_latency_seconds", "Time between consecutive generated tokens.")
        self.e2e = histogram("deepinfer:e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = histogram(
            "deepinfer:request_queue_time_seconds", "Time from arrival to the start of the step that prefilled it."
        )
        self.running = gauge("deepinfer:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("deepinfer:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("deepinfer:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.prefix_queries = counter("deepinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("deepinfer:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("deepinfer:num_preemptions", "Requests preempted (their KV blocks taken back).")
        self.prompt_tokens = counter("deepinfer:prompt_tokens", "Prompt tokens of admitted requests.")
        self.cached_prompt_tokens = counter(
            "deepinfer:prompt_tokens_cached", "Prompt tokens served from the prefix cache."
        )
        self.generation_tokens = counter("deepinfer:generation_tokens", "Generated tokens.")
        self.request_success = counter(
            "deepinfer:request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.rejected = counter(
            "deepinfer:requests_rejected", "Requests refused because the waiting queue was full (HTTP 429)."
        )
        # speculative decoding, vLLM's meanings (exposed with the _total suffix)
        self.spec_drafts = counter("deepinfer:spec_decode_num_drafts", "Verify steps of a request with drafts.")
        self.spec_draft_tokens = counter("deepinfer:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("deepinfer:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter(
            "deepinfer:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first).",
            ("position",),
        )
        self._mirrored = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "preemptions": 0}
        self._spec_mirrored: dict[str, int] = {}

    # -- called in the step thread ----------------------------------------------------------
    def on_output(self, out: RequestOutput, timing: StepTiming) -> None:
        completion = out.outputs[0]
        new_tokens = len(completion.delta_token_ids)
        if timing.first:
            self.ttft.observe(timing.now - timing.arrival)
            self.queue_time.observe(max(0.0, timing.step_start - timing.arrival))
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.cached_prompt_tokens.inc(out.num_cached_tokens)
        elif (
            new_tokens
        ):  # a non-streamed (final_only) request's last output brings all but its first token: each counts the mean gap
            gap = (timing.now - timing.previous) / new_tokens
            for _ in range(new_tokens):
                self.itl.observe(gap)
        self.generation_tokens.inc(new_tokens)
        if out.finished:
            self.e2e.observe(timing.now - timing.arrival)
            self.request_success.labels(self.model_name, completion.finish_reason or "abort").inc()

    def on_abort(self, request_id: str) -> None:
        """A request stopped before it finished (its client went away, the server drained)."""
        self.request_success.labels(self.model_name, "abort").inc()

    def on_early_stop(self, request_id: str, arrival: float) -> None:
        """A request its output parser ended at a stop sequence: a normal stop, not an abort."""
        self.e2e.observe(time.monotonic() - arrival)
        self.request_success.labels(self.model_name, "stop").inc()

    def on_step(self, stats: dict) -> None:
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        for key, metric in (
            ("prefix_cache_queries", self.prefix_queries),
            ("prefix_cache_hits", self.prefix_hits),
            ("preemptions", self.preemptions),
        ):
            value = int(stats.get(key, 0))
            if value > self._mirrored[key]:
                metric.inc(value - self._mirrored[key])
                self._mirrored[key] = value
        spec = stats.get("spec_decode")
        if spec:
            self._mirror_spec(spec)

    def _mirror_spec(self, spec: dict) -> None:
        """The engine's running totals (SpecDecoder.stats) into the counters, by difference."""
        pairs = [
            ("num_drafts", self.spec_drafts, spec.get("num_drafts", 0)),
            ("num_draft_tokens", self.spec_draft_tokens, spec.get("num_draft_tokens", 0)),
            ("num_accepted_tokens", self.spec_accepted_tokens, spec.get("num_accepted_tokens", 0)),
        ]
        for pos, count in enumerate(spec.get("accepted_per_position", ())):
            pairs.append((f"pos{pos}", self.spec_accepted_per_pos.labels(self.model_name, str(pos)), count))
        for key, metric, value in pairs:
            before = self._spec_mirrored.get(key, 0)
            if value > before:
                metric.inc(value - before)
                self._spec_mirrored[key] = value

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
