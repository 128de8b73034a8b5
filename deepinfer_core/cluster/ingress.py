"""The cluster's front door: ``deepinfer serve``'s HTTP app (serve/app.py, every codec's routes)
over a front that forwards each request to the replicas instead of a local engine.

::

    ProtocolRoute (parse, encode, validate)          ClusterFront._run (one asyncio task a request)
      front.submit(Submission, sink) ───────────>      keys = chain_keys(prompt)
                                                       prefill.prefill(Job)   (PD: blocks -> store)
                                                       decode.generate(Job) ─ stream ─> sink.put
      lease.release() ──────────────────────────>      cancel: the replica's generator ends, its
                                                       engine request is aborted

A prefill that fails is not fatal: decode computes whatever the store does not hold (the
request is recomputed, never wrong). A decode replica that fails before the first token is
retried once (Ray's router skips a dead replica). The ingress holds no weights: the tokenizer
and config come from the model's files, the limits from a replica's ``describe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from types import SimpleNamespace

from ..engine import validation
from ..engine.kv_cache_manager import chain_keys
from ..engine.loading import resolve_model_path
from ..models.loaders.formats import open_model_files
from ..serve.app import Server, ServerConfig
from ..serve.front import Closed, QueueFull, RequestSink, Submission
from .board import BOARD_NAMESPACE
from .jobs import Job

__all__ = ["ClusterFront", "ClusterIngress", "ClusterServer", "EngineView", "merge_metrics"]

log = logging.getLogger(__name__)


class EngineView:
    """What the HTTP layer reads from an engine, without loading weights: the model's files
    (tokenizer, config) and a replica's :meth:`~.replica.EngineReplica.describe`."""

    def __init__(self, files, described: dict, max_num_seqs: int) -> None:
        self.files = files
        self.tokenizer = files.tokenizer
        self.model = SimpleNamespace(config=files.config, vocab_size=described["vocab_size"])
        self.max_model_len = described["max_model_len"]
        self.num_blocks = described["num_blocks"]
        self.config = SimpleNamespace(block_size=described["block_size"], max_num_seqs=max_num_seqs)

    def check_prompt_text(self, text: str) -> None:
        if self.tokenizer is not None:
            validation.check_text_size(text, self.max_model_len, self.tokenizer.max_token_chars)


class _Lease:
    def __init__(self, front: "ClusterFront", request_id: str) -> None:
        self._front, self.request_id, self._released = front, request_id, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._front._release(self.request_id)


class ClusterFront:
    """serve/front.py's EngineFront interface (submit, abort, stop_early, stats) over replicas."""

    def __init__(self, decode, prefill, namespace: bytes | None, block_size: int, capacity: int) -> None:
        self.decode = decode  # DeploymentHandle of the decode (or colocated) replicas
        self.prefill = prefill  # DeploymentHandle of the prefill replicas, or None
        self.namespace = namespace
        self.block_size = block_size
        self.capacity = capacity
        self._tasks: dict[str, asyncio.Task] = {}
        self._in_flight = 0
        self._accepting = True
        self._lock = threading.Lock()
        self.counters = {"requests": 0, "prefill_jobs": 0, "prefill_failures": 0, "decode_retries": 0}

    @property
    def stats(self) -> dict:
        return dict(self.counters)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start(self) -> None:
        pass

    def stop_accepting(self) -> None:
        self._accepting = False

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stop_accepting()
        for task in list(self._tasks.values()):
            task.cancel()

    def submit(self, submission: Submission, sink: RequestSink) -> _Lease:
        with self._lock:
            if not self._accepting:
                raise Closed("the server is shutting down")
            if self._in_flight >= self.capacity:
                raise QueueFull(f"{self._in_flight} requests in flight, the limit is {self.capacity}")
            self._in_flight += 1
        self.counters["requests"] += 1
        self._tasks[submission.request_id] = asyncio.ensure_future(self._run(submission, sink))
        return _Lease(self, submission.request_id)

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    stop_early = abort  # the parser found its stop: the rest is not wanted

    def _release(self, request_id: str) -> None:
        self.abort(request_id)
        self._tasks.pop(request_id, None)
        with self._lock:
            self._in_flight -= 1

    async def _run(self, submission: Submission, sink: RequestSink) -> None:
        tokens = tuple(submission.prompt_token_ids)
        keys = tuple(chain_keys(self.namespace, tokens, self.block_size)) if self.namespace is not None else ()
        job = Job(submission.request_id, tokens, submission.params, keys, "decode", submission.final_only)
        admitted = False
        try:
            if self.prefill is not None and (len(tokens) - 1) // self.block_size >= 1:
                self.counters["prefill_jobs"] += 1
                try:
                    await self.prefill.prefill.remote(replace(job, role="prefill"))
                except (ValueError, TypeError):
                    raise
                except Exception:  # a dead prefill replica: decode recomputes what the store lacks
                    self.counters["prefill_failures"] += 1
                    log.warning("prefill of %s failed; decode recomputes it", job.request_id, exc_info=True)
            for attempt in range(2):
                try:
                    async for out in self.decode.options(stream=True).generate.remote(job):
                        if not admitted:
                            admitted = True
                            sink.admit(None)
                        sink.put(out)
                    break
                except (ValueError, TypeError):
                    raise
                except Exception:
                    if admitted or attempt:
                        raise
                    self.counters["decode_retries"] += 1
                    log.warning("decode of %s failed before its first token; retrying", job.request_id, exc_info=True)
            if not admitted:
                sink.admit(None)
                sink.close()
        except asyncio.CancelledError:
            sink.close()
            raise
        except Exception as exc:
            if not admitted:
                sink.admit(exc if isinstance(exc, (ValueError, TypeError)) else RuntimeError(str(exc)))
            else:
                sink.close(exc)


class ClusterServer(Server):
    """``deepinfer serve``'s app plus ``GET /cluster``; ``/metrics`` gathers every replica's."""

    def __init__(self, view: EngineView, host, config: ServerConfig, front: ClusterFront, board) -> None:
        self.board = board
        super().__init__(view, host, config, front=front)

    def _build_app(self):
        app = super()._build_app()
        app.add_api_route("/cluster", self.cluster, methods=["GET"])
        return app

    async def cluster(self):
        view = await self.board.view.remote() if self.board is not None else {"replicas": [], "router_decisions": []}
        return {"ingress": {"in_flight": self.front.in_flight, **self.front.stats}, **view}

    async def render_metrics(self):
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        texts = await self.board.metrics.remote() if self.board is not None else {}
        own, _ = self.metrics.render()
        return Response(merge_metrics({"ingress": own.decode(), **texts}), media_type=CONTENT_TYPE_LATEST)


def merge_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus texts of several processes as one, each sample labelled ``replica``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            metric = merged.get(family.name)
            if metric is None:
                metric = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                metric.samples.append(sample._replace(labels={**sample.labels, "replica": replica}))

    class Merged:
        def collect(self):
            return list(merged.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry)


class ClusterIngress:
    """The ingress deployment (``serve.ingress()`` + ``serve.deployment`` in :mod:`.app`)."""

    async def __init__(
        self, decode, prefill, model: str, server_config: dict, board_name: str | None, max_num_seqs: int
    ) -> None:
        from ..plugin_host import default_host

        described = await decode.describe.remote()
        host = default_host()
        files = open_model_files(resolve_model_path(model, host))
        view = EngineView(files, described, max_num_seqs)
        config = ServerConfig(**server_config)
        board = None
        if board_name is not None:
            import ray

            board = ray.get_actor(board_name, namespace=BOARD_NAMESPACE)
        capacity = 4 * (max_num_seqs + config.max_queue)  # the replicas refuse beyond their own queues
        front = ClusterFront(decode, prefill, described["namespace"], described["block_size"], capacity)
        self.server = ClusterServer(view, host, config, front, board)

    def __serve_build_asgi_app__(self):
        return self.server.app
