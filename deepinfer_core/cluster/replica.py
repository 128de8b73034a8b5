"""One engine replica of the cluster: an :class:`LLMEngine` behind the same step-thread front as
``deepinfer serve`` (serve/front.py), as a Ray Serve deployment.

Roles::

    prefill   prefill(job): compute the prompt (one greedy token, discarded), wait until its full
              blocks are committed in the shared KV store, hold them there for ``job.kv_lease_s``
              (the lease), return the hold and the cached / stored counts
    decode    generate(job): a streamed request; the engine's admission finds the prompt's
              blocks in the store, loads them, and computes only the tail (counted as cached);
              the job's hold is released once the prompt is computed, or when the request is
              cancelled; a failure before that keeps it for the retry on another replica
    both      generate(job) with no prefill step (``--prefill 0``: colocated)

The lease is a hold in the store (``KVStoreHolds``), not a promise between processes: decode
never trusts it, it asks the store, which serves a block only while its retention or a hold
runs (and verifies every record it reads). A lease that ran out before decode came, or while it
read, costs the blocks the store no longer serves: the engine computes them again, so the text
is the same. A decode replica that dies before reading leaves the hold to end at its deadline
(``gc`` then deletes it). A store without holds (a plugin written before them) keeps the blocks
by its retention alone; the replica says so once in its log.

What the replica publishes (never asked per request): ``record_routing_stats`` for the request
router (load, resident KV, the digests of the block keys its device cache holds),
``record_autoscaling_stats`` for the autoscaling policy, and a snapshot plus its Prometheus text
to the cluster board every :data:`PUBLISH_S` for ``GET /cluster`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..engine.config import engine_config
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams
from ..kv_store import KVHold, KVStoreHolds
from ..serve.front import EngineFront, RequestSink, Submission
from ..serve.metrics import ServerMetrics
from .board import BOARD_NAMESPACE
from .jobs import Job
from .router import digest

__all__ = ["EngineReplica", "PUBLISH_S"]

log = logging.getLogger(__name__)
PUBLISH_S = 0.5
STATS_EVERY_S = 0.2  # the step thread refreshes the published snapshot at most this often


class EngineReplica:
    """A Ray Serve deployment class (``serve.deployment(EngineReplica)`` in :mod:`.app`)."""

    def __init__(
        self,
        role: str,
        model: str,
        engine_kwargs: dict,
        served_name: str,
        board_name: str | None = None,
        max_queue: int = 64,
    ):
        self.role = role
        self.engine = LLMEngine(engine_config(model, **engine_kwargs))
        self.metrics = ServerMetrics(served_name)
        self.front = EngineFront(
            self.engine,
            max_queue=max_queue,
            on_output=self.metrics.on_output,
            on_step=self._on_step,
            on_abort=self.metrics.on_abort,
            on_early_stop=self.metrics.on_early_stop,
        )
        self.name = _replica_name(role)
        self.prefill_tokens = 0  # prompt tokens of prefill jobs in flight (the prefill load)
        self.jobs = {"prefill": 0, "decode": 0}
        self.cached_tokens = 0
        self.prompt_tokens = 0
        # holds taken (prefill), received with a decode job, and received already past their deadline
        self.leases = {"taken": 0, "received": 0, "expired": 0}
        self._said_no_holds = False
        self._last_stats = 0.0
        self._snapshot = self._make_snapshot(self.engine.stats())
        self.front.start()
        self._board = None
        if board_name is not None:
            import ray

            self._board = ray.get_actor(board_name, namespace=BOARD_NAMESPACE)
            threading.Thread(target=self._publish_loop, name="deepinfer-publish", daemon=True).start()

    # -- what others ask --------------------------------------------------------------------
    def describe(self) -> dict:
        e = self.engine
        return {
            "namespace": e.kv.namespace if e.kv.enabled else None,
            "block_size": e.config.block_size,
            "max_model_len": e.max_model_len,
            "num_blocks": e.num_blocks,
            "vocab_size": e.model.vocab_size,
            "max_num_seqs": e.config.max_num_seqs,
        }

    async def generate(self, job: Job):
        """Stream the job's :class:`RequestOutput` snapshots (a Ray Serve streaming call)."""
        loop = asyncio.get_running_loop()
        sink = RequestSink(loop, stream=True)
        submission = Submission(job.request_id, job.prompt_token_ids, job.params, final_only=job.final_only)
        hold = self._received(job.kv_hold)
        lease = self.front.submit(submission, sink)
        self.jobs["decode"] += 1
        waiting = len(job.prompt_token_ids)  # not through prefill yet: the load colocated routing reads
        self.prefill_tokens += waiting
        try:
            refused = await sink.admitted
            if refused is not None:
                raise refused
            while (out := await asyncio.to_thread(sink.outputs.get)) is not None:
                if waiting:
                    self.prefill_tokens -= waiting
                    waiting = 0
                    self._count_prompt(out)
                if hold is not None:  # the prompt is computed: its blocks were loaded
                    self._release_hold(hold)
                    hold = None
                yield out
            if sink.final.done() and sink.final.result() is None:
                raise RuntimeError(f"the engine failed: {sink.error}" if sink.error else "the request was aborted")
        except (GeneratorExit, asyncio.CancelledError):  # the client went: nobody reads the blocks now
            self._release_hold(hold)
            raise
        finally:  # a failure before the first token keeps the hold for the ingress's retry elsewhere
            self.prefill_tokens -= waiting
            lease.release()

    async def prefill(self, job: Job) -> dict:
        """Compute the prompt and commit its full blocks to the shared store."""
        params = SamplingParams(temperature=0, max_tokens=1, kv_retention=job.params.kv_retention)
        loop = asyncio.get_running_loop()
        sink = RequestSink(loop, stream=False)
        self.prefill_tokens += len(job.prompt_token_ids)
        self.jobs["prefill"] += 1
        lease = self.front.submit(Submission(job.request_id + "-prefill", job.prompt_token_ids, params), sink)
        try:
            refused = await sink.admitted
            if refused is not None:
                raise refused
            out = await sink.final
            if out is None:
                raise RuntimeError(f"prefill failed: {sink.error}" if sink.error else "prefill was aborted")
            self._count_prompt(out)
        finally:
            lease.release()
            self.prefill_tokens -= len(job.prompt_token_ids)
        if self.engine.tiers is not None:  # the decode replica reads them next: committed first
            await asyncio.to_thread(self.engine.tiers.flush, 60.0)
        hold = await asyncio.to_thread(self._hold, job) if job.kv_lease_s > 0 else None
        bs = self.engine.config.block_size
        return {
            "replica": self.name,
            "cached_tokens": out.num_cached_tokens,
            "stored_blocks": len(job.prompt_token_ids) // bs,
            "hold": hold,  # the lease decode gets, None without one (the store's retention alone)
        }

    # -- the prefill -> decode lease ------------------------------------------------------------
    def _holds(self) -> KVStoreHolds | None:
        store = self.engine.tiers.store if self.engine.tiers is not None else None
        if store is None or isinstance(store, KVStoreHolds):
            return store
        if not self._said_no_holds:
            self._said_no_holds = True
            log.warning(
                "KV store %r has no holds (hold / release_hold): prefill -> decode leases fall back to its retention",
                getattr(store, "name", type(store).__name__),
            )
        return None

    def _hold(self, job: Job) -> KVHold | None:
        """Prefill: hold the prompt's committed blocks for ``job.kv_lease_s`` (the lease handed to
        decode). None without a store that holds, or when the hold fails: decode then finds the
        blocks by their retention, or computes them."""
        store = self._holds()
        if store is None or not job.block_keys:
            return None
        try:
            hold = store.hold(job.block_keys, job.kv_lease_s)
        except Exception as exc:
            log.warning("KV store hold of %d blocks failed (decode relies on their retention): %s",
                        len(job.block_keys), exc)  # fmt: skip
            return None
        self.leases["taken"] += 1
        return hold

    def _received(self, hold: KVHold | None) -> KVHold | None:
        """Decode: count a job's hold. One already past its deadline is not trusted: the store
        serves what is still valid, the engine computes the rest."""
        if hold is not None:
            self.leases["received"] += 1
            if hold.expires_at <= time.time():
                self.leases["expired"] += 1
                log.info("the lease of %d blocks ran out before decode: they are loaded if still stored, "
                         "else computed", len(hold.keys))  # fmt: skip
        return hold

    def _release_hold(self, hold: KVHold | None) -> None:
        """End prefill's hold (the blocks are loaded or no longer wanted); a failure only lets
        the hold run to its deadline."""
        store = self._holds() if hold is not None else None
        if store is not None:
            try:
                store.release_hold(hold)
            except Exception as exc:
                log.warning("KV store release of a hold failed (it ends at its deadline): %s", exc)

    def _count_prompt(self, out) -> None:  # once per job, at its first snapshot
        self.prompt_tokens += len(out.prompt_token_ids)
        self.cached_tokens += out.num_cached_tokens

    def record_routing_stats(self) -> dict:
        return self._snapshot["routing"]

    def record_autoscaling_stats(self) -> dict:
        s = self._snapshot
        return {"waiting_prompt_tokens": float(self.prefill_tokens), "running_requests": float(s["running"])}

    def check_health(self) -> None:
        if not self.front._thread.is_alive():
            raise RuntimeError("the engine's step thread has stopped")

    def __del__(self) -> None:
        front = getattr(self, "front", None)
        if front is not None:
            front.shutdown()

    # -- publishing -------------------------------------------------------------------------
    def _on_step(self, stats: dict) -> None:  # step thread
        self.metrics.on_step(stats)
        now = time.monotonic()
        if now - self._last_stats >= STATS_EVERY_S:
            self._last_stats = now
            self._snapshot = self._make_snapshot(stats)

    def _make_snapshot(self, stats: dict) -> dict:
        kv = self.engine.kv
        resident = round(kv.usage() * kv.pool.num_blocks)
        keys = [digest(k) for k in list(kv.pool.cached)]  # step thread: the pool does not change under us
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        routing = {
            "name": self.name, "role": self.role, "running": stats.get("running", 0),
            "waiting": stats.get("waiting", 0), "waiting_tokens": self.prefill_tokens,
            "resident_blocks": resident, "num_blocks": kv.pool.num_blocks, "prefix_keys": keys,
            "at": time.time(),  # what the router has sent since is not in these figures (RoutedLedger)
        }  # fmt: skip
        return {
            "routing": routing,
            "running": routing["running"],
            "view": {
                "name": self.name, "role": self.role, "running": routing["running"], "waiting": routing["waiting"],
                "waiting_prompt_tokens": self.prefill_tokens, "resident_kv_blocks": resident,
                "kv_blocks": kv.pool.num_blocks, "cached_blocks": len(keys),
                "prefix_hit_rate": round(hits / queries, 4) if queries else None,
                "prompt_tokens": self.prompt_tokens, "prompt_tokens_cached": self.cached_tokens,
                "prefill_jobs": self.jobs["prefill"], "decode_jobs": self.jobs["decode"],
                "leases_taken": self.leases["taken"], "leases_received": self.leases["received"],
                "leases_expired": self.leases["expired"],
            },
        }  # fmt: skip

    def _publish_loop(self) -> None:
        while True:
            try:
                if not self.engine.has_unfinished_requests():  # idle: no step refreshes it
                    self._snapshot = self._make_snapshot(self.front.stats)
                body, _ = self.metrics.render()
                self._board.publish.remote(self.name, self._snapshot["view"], body.decode())
            except Exception:  # the board is optional: routing does not go through it
                log.debug("publishing to the cluster board failed", exc_info=True)
            time.sleep(PUBLISH_S)


def _replica_name(role: str) -> str:
    try:
        from ray import serve

        return f"{role}-{serve.get_replica_context().replica_id.unique_id}"
    except Exception:  # outside Ray Serve (tests of the class itself)
        return f"{role}-local"
