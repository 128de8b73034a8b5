"""The cluster's front door: ``deepinfer serve``'s HTTP app (serve/app.py, every codec's routes)
over a front that forwards each request to the replicas instead of a local engine.

::

    ProtocolRoute (parse, encode, validate)          ClusterFront._run (one asyncio task a request)
      front.submit(Submission, sink) ───────────>      keys = chain_keys(prompt)
                                                       prefill.prefill(Job)   (PD: blocks -> store,
                                                                               held: the lease)
                                                       decode.generate(Job + hold) ─ stream ─> sink.put
      lease.release() ──────────────────────────>      cancel: the replica's generator ends, its
                                                       engine request is aborted

A prefill that fails (its replica died, mid-write too) is not fatal: decode computes whatever
the store does not hold (the request is recomputed, never wrong). A prefill that succeeds hands
back a hold on the prompt's blocks for ``kv_lease_s`` (the lease); the decode job carries it and
the decode replica releases it once the blocks are loaded (replica.py says what a lease that ran
out does: recompute). A decode replica that fails before the first token is retried once (Ray's
router skips a dead replica). The ingress holds no weights: the tokenizer and config come from
the model's files, the limits from a replica's ``describe``.
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
from ..kv_store import KVHold
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

    def __init__(
        self,
        decode,
        prefill,
        namespace: bytes | None,
        block_size: int,
        capacity: int,
        prefill_timeout_s: float = 60.0,
        decode_retries: int = 2,
        kv_lease_s: float = 60.0,
    ) -> None:
        self.prefill_timeout_s = prefill_timeout_s
        self.kv_lease_s = kv_lease_s
        self.decode_retries = decode_retries
        self.decode = decode  # DeploymentHandle of the decode (or colocated) replicas
        self.prefill = prefill  # DeploymentHandle of the prefill replicas, or None
        self.namespace = namespace
        self.block_size = block_size
        self.capacity = capacity
        self._tasks: dict[str, asyncio.Task] = {}
        self._in_flight = 0
        self._accepting = True
        self._lock = threading.Lock()
        self.counters = {
            "requests": 0, "prefill_jobs": 0, "prefill_failures": 0, "decode_retries": 0,
            "leases": 0,  # decode jobs that carried a prefill's hold on their blocks
            # streams continued on another replica after tokens had gone out (a replica killed,
            # or stopped at the end of its drain), and the tokens those continuations found
            # cached (the moved request's KV, loaded from the store instead of recomputed)
            "migrations": 0, "migrated_cached_tokens": 0,
        }  # fmt: skip

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
        stream = _Continuation(job, sink, self.counters)
        try:
            if self.prefill is not None and (len(tokens) - 1) // self.block_size >= 1:
                stream.first = await self._prefill(job)
            for attempt in range(1 + self.decode_retries):
                try:
                    async for out in self.decode.options(stream=True).generate.remote(stream.job()):
                        stream.put(out)
                    break
                except (ValueError, TypeError):
                    raise
                except Exception:  # the replica died (or was drained away): continue elsewhere
                    if attempt == self.decode_retries:
                        raise
                    self.counters["decode_retries"] += 1
                    log.warning("decode of %s failed after %d tokens; continuing on another replica",
                                job.request_id, len(stream.ids), exc_info=True)  # fmt: skip
            stream.end()
        except asyncio.CancelledError:
            sink.close()
            raise
        except Exception as exc:
            stream.fail(exc)

    async def _prefill(self, job: Job) -> Job:
        """PD: the prompt's blocks into the store, held there for ``kv_lease_s``; returns the
        decode job, carrying prefill's hold when there is one (not with a store that has no
        holds). A failure or a timeout only costs time: the decode replica computes whatever
        the store does not hold."""
        self.counters["prefill_jobs"] += 1
        response = self.prefill.prefill.remote(replace(job, role="prefill", kv_lease_s=self.kv_lease_s))
        try:
            result = await asyncio.wait_for(asyncio.ensure_future(_awaited(response)), self.prefill_timeout_s)
        except (ValueError, TypeError):
            raise
        except Exception:  # a dead prefill replica (mid-write too: nothing half-written is served), a timeout
            response.cancel()
            self.counters["prefill_failures"] += 1
            log.warning("prefill of %s failed; decode recomputes it", job.request_id, exc_info=True)
            return job
        hold = result.get("hold") if isinstance(result, dict) else None
        if not isinstance(hold, KVHold):
            return job
        self.counters["leases"] += 1
        return replace(job, kv_hold=hold)


async def _awaited(response):
    return await response


class _Continuation:
    """One request's outputs across decode attempts. A retry sends the prompt plus the tokens
    already streamed, asks for the rest, and its snapshots are rebased on what was sent, so the
    client sees one reply: no token repeated, none dropped (greedy and seeded sampling pick the
    same tokens, the noise being a function of seed and position)."""

    def __init__(self, job: Job, sink: RequestSink, counters: dict | None = None) -> None:
        self.first, self.sink = job, sink
        self.counters = counters if counters is not None else {}
        self.continued = False  # the current attempt continues tokens already sent
        self.ids: list[int] = []  # tokens sent to the client, over all attempts
        self.text = ""
        self.base_ids: list[int] = []  # what earlier attempts produced (the current one's offset)
        self.base_text = ""
        self.admitted = False
        self.num_cached_tokens = 0
        self.attempts = 0

    def job(self) -> Job:
        self.base_ids, self.base_text = list(self.ids), self.text
        self.attempts += 1
        if not self.ids:  # nothing sent yet: the same job again (a fresh id: the old may linger)
            return self.first if self.attempts == 1 else replace(self.first, request_id=self._attempt_id())
        self.continued = True
        self.counters["migrations"] = self.counters.get("migrations", 0) + 1
        params = replace(self.first.params, max_tokens=max(1, self.first.max_tokens - len(self.ids)))
        params.min_tokens = max(0, params.min_tokens - len(self.ids))
        prompt = self.first.prompt_token_ids + tuple(self.ids)
        return replace(
            self.first,
            request_id=self._attempt_id(),
            prompt_token_ids=prompt,
            params=params,
            block_keys=(),
            kv_hold=None,  # released by the replica that produced the tokens
        )

    def _attempt_id(self) -> str:
        return f"{self.first.request_id}-{self.attempts}"

    def put(self, out) -> None:
        completion = out.outputs[0]
        if self.continued:  # the continuation's first snapshot: what it found cached
            self.continued = False
            self.counters["migrated_cached_tokens"] = (
                self.counters.get("migrated_cached_tokens", 0) + out.num_cached_tokens
            )
        if self.base_ids:
            out.prompt_token_ids = list(self.first.prompt_token_ids)
            out.num_cached_tokens = self.num_cached_tokens
            completion.token_ids = self.base_ids + list(completion.token_ids)
            completion.text = self.base_text + completion.text
        else:
            self.num_cached_tokens = out.num_cached_tokens
        self.ids, self.text = list(completion.token_ids), completion.text
        if not self.admitted:
            self.admitted = True
            self.sink.admit(None)
        self.sink.put(out)

    def end(self) -> None:
        if not self.admitted:
            self.sink.admit(None)
            self.sink.close()

    def fail(self, exc: BaseException) -> None:
        if not self.admitted:
            self.sink.admit(exc if isinstance(exc, (ValueError, TypeError)) else RuntimeError(str(exc)))
        else:
            self.sink.close(exc)


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
        self,
        decode,
        prefill,
        model: str,
        server_config: dict,
        board_name: str | None,
        max_num_seqs: int,
        prefill_timeout_s: float = 60.0,
        kv_lease_s: float = 60.0,
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
        front = ClusterFront(
            decode,
            prefill,
            described["namespace"],
            described["block_size"],
            capacity,
            prefill_timeout_s,
            kv_lease_s=kv_lease_s,
        )
        self.server = ClusterServer(view, host, config, front, board)

    def __serve_build_asgi_app__(self):
        return self.server.app
