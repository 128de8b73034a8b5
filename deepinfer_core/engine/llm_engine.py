"""LLMEngine: one instance serving many requests. ``step()`` is the whole loop::

    scheduler.schedule() -> runner.execute() -> scheduler.update() -> outputs (+ stop checks)

Every public method holds one re-entrant lock, so threads may add, abort and step at once.
A request is validated in full when it enters (:mod:`.validation`); inside a step, a failure
is contained to the request that caused it, or fails every request when it belongs to none
(:mod:`.isolation`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import threading
from typing import Sequence

import torch

from .. import envs, fused_ops
from ..parallel.load import ExpertLoadCounter
from ..plugin_host import PluginHost, default_host
from . import kv_tiers, loading, overlap, spec_decode, validation
from .config import EngineConfig
from .isolation import describe
from .kv_cache_manager import KVCacheManager
from .kv_sizing import kv_sizing
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .request import Request
from .sampler import SamplingRow, sampling_row
from .sampling_params import SamplingParams
from .scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from .state_kv_manager import StateKVSlots
from .state_replay import StateRebuild
from .window_cache import WindowCache, state_tensors

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, host: PluginHost | None = None, parallel=None, prepare_model=None) -> None:
        """``parallel``: this rank's :class:`~deepinfer_core.moe.ParallelConfig` when the engine
        is one rank of a parallel group (``deepinfer_core.engine.parallel`` builds it), and
        ``prepare_model`` what it does to the model before loading (``loading.build_model``)."""
        self.config = config
        self.parallel = parallel
        self.host = host or default_host()
        self.platform = self.host.platform(config.device)
        self.device = self.platform.torch_device(_device_index(config.device))
        self.dtype = config.torch_dtype(self.platform.device_type)
        window = config.expert_load_window  # per-expert load for EPLB, counted on the device
        self.expert_load = ExpertLoadCounter(self.device, window) if window else None
        self.files, self.model, ctx, self.weight_format, self.weights_choice = loading.load(
            config.model,
            self.host,
            self.platform,
            self.device,
            self.dtype,
            config.attention_backend,
            config.moe_backend,
            requested_dtype=config.dtype,
            kv_cache_dtype=config.kv_cache_dtype,
            weight_format=config.weight_format,
            parallel=parallel,
            prepare_model=prepare_model,
            expert_load=self.expert_load,
        )
        self.dtype = ctx.dtype  # a weight format may compute in its own dtype (low-bit: float32)
        if config.batch_invariant and self.weight_format is not None:
            self.weight_format.use_batch_invariant_kernels(self.model)
        self.num_fused = fused_ops.install(self.model, self.host.fused_ops(self.platform)) if config.fused_ops else 0
        if hasattr(self.model, "fused_step"):  # a whole step in one call (deepinfer_fused_decode_step), or None
            self.model.fused_step = self.host.fused_decode_step(self.model, self.platform)
        weights = self.weight_format.describe(self.model) if self.weight_format is not None else "dense"
        self.tokenizer = self.files.tokenizer
        self.max_model_len = min(
            config.max_model_len or self.model.max_position_embeddings, self.model.max_position_embeddings
        )

        bs = config.block_size
        spec_cfg = config.speculative_config  # a checked SpecConfig, or None
        gamma = spec_cfg.num_speculative_tokens if spec_cfg is not None else 0
        self.kv_sizing = sizing = kv_sizing(
            self.model, ctx.attention_backend, bs, config.max_num_seqs, gamma
        )  # also `deepinfer plan`'s
        block_bytes = sizing.block_bytes
        if config.kv_cache_blocks:
            self.num_blocks = config.kv_cache_blocks
        elif config.kv_cache_gib is not None:
            self.num_blocks = sizing.blocks_for_budget(config.kv_cache_gib * 2**30)
        else:
            self.num_blocks = self._default_num_blocks(block_bytes, sizing.state_bytes)
        rank = parallel.rank if parallel is not None else 0
        namespace = hashlib.sha256(
            f"{self.files.fingerprint}|{sizing.layout}|bs={bs}|rank={rank}|weights={weights}".encode()
        ).hexdigest()  # packed vs dense weights compute different KV
        graphs = None if config.enforce_eager or config.batch_invariant else self.host.decode_graphs(self.platform)
        scratch = 1 if graphs is not None else 0  # block num_blocks: where padded graph rows write
        kv_caches = sizing.allocate(self.num_blocks + scratch, self.device)
        state = StateKVSlots(sizing.num_state_slots) if sizing.num_state_slots else None  # DeepSeek-V4
        self.kv = KVCacheManager(self.num_blocks, bs, namespace if config.enable_prefix_caching else None)
        self.kv.state = state
        # state KV after a prefix hit: the window cache, else a replay (exact or compact; see state_replay)
        self.rebuild = None if state is None else _state_rebuild(config, self.model.kv_layout(bs), state, kv_caches)
        self.tiers = None if config.kv_store is None else kv_tiers.open_tiers(
            config.kv_store, namespace=namespace, kv=self.kv, kv_caches=kv_caches,
            shapes_one_two=kv_tiers.cache_shapes(sizing), device=self.device, capacity_gib=config.kv_store_gib,
            host_pool_gib=config.kv_host_pool_gib, plugin_host=self.host,
        )  # fmt: skip
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv, self.tiers
        )
        self.runner = ModelRunner(self.model, kv_caches, bs, self.device, config.batch_invariant, state)
        self.runner.expert_load = self.expert_load
        if config.batch_invariant:
            self.runner.invariant_ops = self.host.batch_invariant_ops(self.platform)
        if graphs is not None:
            rows = config.max_num_seqs
            if gamma and self.runner.verify_as_decode_rows:  # verify steps replay the buckets too: a row per token
                rows = max(rows, min(config.max_num_seqs * (gamma + 1), config.max_num_batched_tokens))
            self.runner.graphs = graphs(
                self.model, kv_caches, block_size=bs, scratch_block=self.num_blocks,
                max_num_seqs=rows, max_blocks=-(-self.max_model_len // bs),
            )  # fmt: skip
        self.outputs = OutputProcessor(self.tokenizer, state_metrics=state is not None)
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)
        self.limits = validation.ModelLimits(
            self.model.vocab_size, self.max_model_len, bs, self.num_blocks, self.tokenizer is not None
        )
        self._lock = threading.RLock()
        self._stepping = False  # an abort that arrives re-entrantly mid-step waits for the next step
        self._deferred_aborts: list[str] = []
        # speculative decoding (engine/spec_decode.py); DSpark may time a few forwards here
        self.spec = None if spec_cfg is None else self._spec_decoder(spec_cfg)
        self.outputs.spec_metrics = self.spec is not None
        # overlapped scheduling (engine/overlap.py): the step launched but not yet committed
        self.overlap = overlap.enabled(config.overlap_scheduling, self.platform.device_type, self.tiers is not None)
        # with speculation a step runs serially (its drafts need the step before it committed),
        # except DSpark's streaks of plain steps (K = 0, decided ahead), which overlap as usual
        self._plain_overlap = self.overlap and self.spec is not None
        if self.overlap and self.spec is not None:
            log.info("speculative decoding runs serial steps; DSpark's plain streaks (K = 0) overlap")
            self.overlap = False
        self.overlap_debug = config.overlap_debug or envs.get("DEEPINFER_OVERLAP_DEBUG")
        self._in_flight: overlap.InFlight | None = None
        # a rank of a parallel group: agrees every step with the other ranks before its forward
        # (engine/parallel/lockstep.py: the vote, and the empty passes of a rank with less work)
        self.lockstep = None
        kv_dtype = (
            getattr(kv_caches[0], "dtype", self.dtype) if kv_caches else self.dtype
        )  # a weight format's cache may differ (low-bit: float16 under float32)
        kv_note = "" if kv_dtype == self.dtype else f", KV cache {str(kv_dtype).removeprefix('torch.')}"
        log.info(
            "deepinfer engine: %s on %s (%s%s), %d KV blocks of %d tokens (%.1f MiB); weights %s (%s)%s",
            config.model,
            self.platform.name,
            self.dtype,
            kv_note,
            self.num_blocks,
            bs,
            self.num_blocks * block_bytes / 2**20,
            weights,
            self.weights_choice,
            _cpu_note(self.platform.device_type),
        )

    def _spec_decoder(self, spec_cfg) -> spec_decode.SpecDecoder:
        from ..speculative import DrafterContext

        draft_dtype = self.dtype
        if self.device.type == "cpu":  # a drafter's float weights: bf16 only where the CPU multiplies it natively
            from ..builtin.cpu_features import cpu_features

            draft_dtype = cpu_features().auto_dtype
        ctx = DrafterContext(self.model, self.config.model, self.device, self.dtype, self.tokenizer, draft_dtype)
        # the curve times graph replays (_time_forward) where it can: their buckets depend on these
        replayed = (self.config.max_num_seqs, spec_cfg.num_speculative_tokens) if self._idle_replay() else None
        spec = spec_decode.build_spec_decoder(
            spec_cfg, self.host, ctx, max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len, measure=self._time_forward,
            curve_key=(self.files.fingerprint, str(self.device), str(self.dtype), self.weights_choice, replayed),
        )  # fmt: skip
        self.runner.keep_hidden = spec.needs_hidden
        self.scheduler.on_release = spec.release
        capture = getattr(self.runner.graphs, "capture_draft", None)  # the drafter's chain in graphs too
        if capture is not None and hasattr(spec.drafter, "use_graphs"):
            spec.drafter.use_graphs(capture, self.config.max_num_seqs, spec_cfg.num_speculative_tokens)
        if self.runner.graphs is not None and not self.runner.verify_as_decode_rows:
            log.info("speculative decoding: verify steps run eagerly (this model's verify is not decode-shaped)")
        log.info(
            "speculative decoding: %s, %d tokens, %s verification",
            spec_cfg.method,
            spec_cfg.num_speculative_tokens,
            spec_cfg.verification,
        )
        return spec

    @torch.inference_mode()
    def _time_forward(self, num_tokens: int) -> None:
        """One target step of ``num_tokens`` tokens (DSpark's steps/s curve), as the engine would
        run it: a captured decode graph of that many padding rows where verify steps replay the
        graphs (a GPU: an eager forward there costs 10x a replayed step, H100), else one eager
        forward over ``num_tokens`` new tokens. Returns when the device is done."""
        idle = self._idle_replay()
        if idle is not None and idle(num_tokens):
            self.platform.synchronize()
            return
        n = min(num_tokens, self.max_model_len - 1, self.num_blocks * self.config.block_size - 1)
        span = max(1, min(97, self.model.vocab_size - 1))  # ids 1..span: valid in any vocabulary
        self._prompt_logits([1 + (i % span) for i in range(max(1, n))])

    def _idle_replay(self):
        """The decode graphs' ``replay_idle`` where verify steps replay the graphs (decode rows),
        else None: what DSpark's curve times instead of an eager forward (_time_forward)."""
        return getattr(self.runner.graphs, "replay_idle", None) if self.runner.verify_as_decode_rows else None

    def _default_num_blocks(self, block_bytes: int, reserved_bytes: int = 0) -> int:
        free, _total = self.platform.memory_info()
        fraction, cap = (0.25, 1 << 30) if self.platform.device_type == "cpu" else (0.8, None)
        budget = free * fraction if cap is None else min(free * fraction, cap)
        budget -= reserved_bytes  # state KV, allocated beside the blocks
        enough = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        return max(1, min(int(budget // block_bytes), enough))

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
        *,
        final_only: bool = False,
    ) -> str:
        """Validate and enqueue. Raises ValueError or TypeError (naming the problem) and
        changes nothing when the request cannot be served. The engine keeps its own validated
        copy of ``params`` and of the prompt: changing them afterwards has no effect.
        ``final_only``: as for :meth:`add_checked` (a caller that reads only the last output)."""
        with self._lock:
            return self._add(self._checked(prompt_token_ids, params), prompt, request_id, final_only)

    def check_batch(self, requests: Sequence[tuple[list[int], SamplingParams]]) -> list[validation.CheckedRequest]:
        """Check every ``(prompt_token_ids, params)`` of a batch before any of them is added, so
        that a batch with one bad request adds none: raises what :meth:`add_request` would raise
        for the first bad one, its message prefixed with ``prompt i:``, and changes nothing. A
        params object given for several prompts is copied and checked once (they share the copy,
        which the engine never changes)."""
        copies: dict[int, SamplingParams] = {}
        checked = []
        for i, (ids, params) in enumerate(requests):
            try:
                if id(params) not in copies:  # ``requests`` holds the object: its id stays its own
                    copies[id(params)] = _params_copy(params)
                checked.append(self._check_prompt(ids, copies[id(params)]))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
        return checked

    def add_checked(
        self,
        checked: validation.CheckedRequest,
        prompt: str | None = None,
        request_id: str | None = None,
        *,
        final_only: bool = False,
    ) -> str:
        """Enqueue a request that :meth:`check_batch` accepted, without checking it again (the
        request id and ``prompt`` still are). ``final_only``: :meth:`step` returns only the
        request's first output (its first token: a server's time to first token) and its last
        (finished), not a snapshot each time it gains a token (building them was a third of a
        256-request decode step's host time, for callers that drop them)."""
        if not isinstance(checked, validation.CheckedRequest):
            raise TypeError(f"add_checked takes what check_batch returned, got {type(checked).__name__}")
        with self._lock:
            return self._add(checked, prompt, request_id, final_only)

    def _add(self, checked: validation.CheckedRequest, prompt, request_id, final_only: bool = False) -> str:
        prompt_token_ids, params = checked.prompt_token_ids, checked.params
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string or None, got {type(request_id).__name__}")
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string or None, got {type(prompt).__name__}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        room = self.max_model_len - len(prompt_token_ids)
        eos = () if params.ignore_eos or self.tokenizer is None else tuple(self.tokenizer.stop_token_ids)
        eos = eos or (() if params.ignore_eos else tuple(_config_eos(self.model.config)))
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,  # the checked copy: the engine's own
            params=params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            eos_token_ids=eos,
            max_tokens=min(params.max_tokens or room, room),
            prompt=prompt,
            final_only=final_only,
            prompt_array=checked.prompt_array,
        )
        self.scheduler.add(req)
        self.outputs.add(req)
        return request_id

    def validate(self, prompt_token_ids, params: SamplingParams) -> None:
        """Raise what :meth:`add_request` would raise for this request; change nothing."""
        self._checked(prompt_token_ids, params)

    def _checked(self, prompt_token_ids, params) -> validation.CheckedRequest:
        return self._check_prompt(prompt_token_ids, _params_copy(params))

    def _check_prompt(self, prompt_token_ids, params: SamplingParams) -> validation.CheckedRequest:
        """``params``: already the engine's checked copy."""
        ids, array = validation.checked_prompt(prompt_token_ids, self.limits)
        validation.check_params(params, len(ids), self.limits)
        return validation.CheckedRequest(ids, params, array)

    def check_prompt_text(self, text: str) -> None:
        """Refuse a text prompt that is surely longer than the context, before tokenizing it."""
        if self.tokenizer is not None:
            validation.check_text_size(text, self.max_model_len, self.tokenizer.max_token_chars)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request now (``finish_reason="abort"``); returns its last output, or None
        when it is unknown or already finished. Called re-entrantly from inside a step (a
        stream closed by the garbage collector there), the abort happens at the next step."""
        with self._lock:
            if self._stepping:
                self._deferred_aborts.append(request_id)
                return None
            req = self.scheduler.abort(request_id)
            return self.outputs.finish(req) if req is not None else None

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self._lock:
            for request_id in self._deferred_aborts:
                self.abort_request(request_id)
            self._deferred_aborts.clear()
            self._stepping = True
            try:
                if self.overlap:
                    return self._step_overlapped()
                running = len(self.scheduler.running)
                if self._plain_overlap and self.lockstep is None and self.spec.plain_ahead(running):
                    self.spec.note_plain_step(running)
                    return self._step_overlapped()
                try:
                    flight, self._in_flight = self._in_flight, None  # a plain streak's last step, committed first
                    drained = self._commit(flight) if flight is not None else []
                    sched = self.scheduler.schedule()
                    replay = self._replays(sched)
                    if self.lockstep is not None:
                        self.lockstep.align(sched, replay)
                    result = self.runner.execute(sched, self._sampling_rows(sched), replay)
                    changed = self.scheduler.update(sched, result.sampled, result.verified)
                    if self.spec is not None:
                        self._record_verified(sched, result.verified)
                    if self.rebuild is not None:  # before any request finishes: its state at a block boundary
                        self.rebuild.after_step(sched, self.scheduler.requests)  # serial steps only (see there)
                    if self.tiers is not None:  # new full blocks -> host -> store (writer thread)
                        self.tiers.write_back(
                            [
                                self.scheduler.requests[s.request_id]
                                for s in sched.requests
                                if s.request_id in self.scheduler.requests
                            ]
                        )
                except Exception as exc:  # no single request is at fault: fail them all
                    log.exception("engine step failed; failing every request")
                    return [self._fail(req, describe(exc)) for req in list(self.scheduler.requests.values())]
                outputs = drained + [self._fail(self.scheduler.requests[i], msg) for i, msg in result.failed.items()]
                outputs += [out for req in changed if (out := self._process(req)) is not None]
                if self.spec is not None:  # drafts for the next step, from what this one committed
                    try:
                        self.spec.propose(self.scheduler.running, result.hidden, result.hidden_row)
                    except Exception as exc:
                        log.exception("drafting failed; failing every request")
                        return outputs + [
                            self._fail(req, describe(exc)) for req in list(self.scheduler.requests.values())
                        ]
                return outputs
            finally:
                self._stepping = False

    def _step_overlapped(self) -> list[RequestOutput]:
        """Launch the next step, then commit the one in flight (see engine/overlap.py)."""
        outputs: list[RequestOutput] = []
        flight, self._in_flight = self._in_flight, None
        try:
            cont = overlap.continuation(self.scheduler, flight) if flight is not None else None
            if flight is not None and cont is None:
                outputs += self._commit(flight)
                flight = None
            if cont is not None:
                sched, rows, fed, chain = cont
                reqs = flight.requests  # the same requests, each still under its id (continuation checked)
            else:
                sched, fed, chain = self.scheduler.schedule(), None, None
                rows = self._sampling_rows(sched)
                reqs = tuple(self.scheduler.requests[s.request_id] for s in sched.requests)
            if sched.requests:
                replay = None if cont is not None else self._replays(sched)  # a continuation's requests hold state
                self._in_flight = overlap.InFlight(self.runner.launch(sched, rows, replay, fed), reqs, chain)
            if flight is not None:
                outputs += self._commit(flight)
        except Exception as exc:  # no single request is at fault: fail them all
            log.exception("engine step failed; failing every request")
            self._in_flight = None
            return outputs + [self._fail(req, describe(exc)) for req in list(self.scheduler.requests.values())]
        return outputs

    def _commit(self, flight: overlap.InFlight) -> list[RequestOutput]:
        """Wait for a launched step's ids; account them to the requests still running it."""
        result = self.runner.collect(flight.launched)
        sched = overlap.alive(self.scheduler, flight, self.overlap_debug)
        if sched.requests is flight.launched.sched.requests:  # every row kept (the usual case): nothing to filter
            sampled, failed = result.sampled, result.failed
        else:
            kept = {s.request_id for s in sched.requests}
            sampled = {i: t for i, t in result.sampled.items() if i in kept}
            failed = {i: msg for i, msg in result.failed.items() if i in kept}
        changed = self.scheduler.update(sched, sampled)
        outputs = [self._fail(self.scheduler.requests[i], msg) for i, msg in failed.items()]
        return outputs + [out for req in changed if (out := self._process(req)) is not None]

    def _replays(self, sched: SchedulerOutput) -> SchedulerOutput | None:
        """The state-KV replay steps ``sched`` needs first, after the window cache served what it
        holds (models with state KV, see state_replay)."""
        if self.rebuild is None:
            return None
        return self.rebuild.replays(sched, self.scheduler.requests)

    def _record_verified(self, sched: SchedulerOutput, verified: dict[str, list[int]]) -> None:
        for s in sched.requests:
            if s.num_spec and s.request_id in verified:
                self.spec.record(self.scheduler.requests[s.request_id], s.num_spec, verified[s.request_id])

    def _sampling_rows(self, sched: SchedulerOutput) -> dict[str, SamplingRow]:
        rows = {}
        for s in sched.requests:
            if s.num_spec:  # one row per verified position
                req = self.scheduler.requests[s.request_id]
                drafts = list(s.token_ids[len(s.token_ids) - s.num_spec :])
                stops = req.eos_token_ids + tuple(req.params.stop_token_ids)
                min_tokens = req.params.min_tokens
                rows[s.request_id] = spec_decode.SpecDecoder.verify_rows(
                    req, drafts, lambda n_out: stops if n_out < min_tokens else ()
                )
                continue
            if s.sample:
                req = self.scheduler.requests[s.request_id]
                suppressed = (
                    req.eos_token_ids + tuple(req.params.stop_token_ids)
                    if len(req.output_token_ids) < req.params.min_tokens
                    else ()
                )
                rows[s.request_id] = sampling_row(
                    req.params, req.seed, req.num_tokens, req.prompt_token_ids, req.output_token_ids, suppressed
                )
        return rows

    def _process(self, req: Request) -> RequestOutput | None:
        """Stop checks and detokenization of the request's new token, contained to it; None
        when the request runs on past its first token and its caller wants only its last output."""
        try:
            if req.num_new_tokens > 1:  # a verify step's tokens, checked one at a time
                reason, stop_reason = self._process_several(req)
            else:
                reason, stop_reason = self.outputs.process(req)
            if reason is not None:
                self.scheduler.finish(req, reason, stop_reason)
            elif req.final_only and len(req.output_token_ids) > 1:  # its first output still comes
                return None
            return self.outputs.snapshot(req)
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            return self._fail(req, describe(exc))

    def _process_several(self, req: Request) -> tuple[str | None, int | str | None]:
        """Stop checks over the tokens a verify step appended, in order; tokens after the one
        that finishes the request are dropped (as if they had never been sampled)."""
        n = req.num_new_tokens
        new = req.output_token_ids[-n:]
        del req.output_token_ids[-n:]
        req.num_new_tokens = 1
        for token in new:
            req.output_token_ids.append(token)
            reason, stop_reason = self.outputs.process(req)
            if reason is not None:
                return reason, stop_reason
        return None, None

    def _fail(self, req: Request, message: str) -> RequestOutput:
        """Finish ``req`` with ``finish_reason="error"`` and free its blocks."""
        self.scheduler.finish(req, "error", None)
        return self.outputs.error(req, message)

    @torch.inference_mode()
    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Logits at every prompt position ([T, V] float32), computed in one forward over
        blocks borrowed from the pool (and returned; nothing is published to the prefix cache).
        For scoring and for checking the engine against a reference."""
        with self._lock:
            return self._prompt_logits(prompt_token_ids)

    def prompt_hidden(self, prompt_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`prompt_logits` and the last layer's output before the final norm at every
        prompt position ([T, D]; the model's ``forward_hidden``): what the engine's own forward
        (packed weights and native kernels included) gives a drafter to read. For training a
        drafter on the target as it serves (``deepinfer train-drafter --teacher engine``)."""
        with self._lock:
            return self._prompt_logits(prompt_token_ids, hidden=True)

    def _prompt_logits(self, prompt_token_ids: list[int], hidden: bool = False):
        prompt_token_ids = self._checked(prompt_token_ids, SamplingParams(max_tokens=1)).prompt_token_ids
        req = Request("__score__", list(prompt_token_ids), SamplingParams(max_tokens=1), seed=0)
        if not self.kv.allocate(req, len(prompt_token_ids)):
            raise RuntimeError("not enough free KV blocks to score this prompt now")
        try:
            sched = SchedulerOutput(
                (
                    ScheduledRequest(
                        req.request_id,
                        tuple(prompt_token_ids),
                        0,
                        tuple(req.block_ids),
                        False,
                        0,
                        len(prompt_token_ids),
                    ),
                ),
                len(prompt_token_ids),
            )
            input_ids, meta, _ = self.runner.build_batch(sched)
            if hidden:
                normed, pre = self.model.forward_hidden(input_ids, meta.positions, self.runner.kv_caches, meta)
                return self.model.compute_logits(normed), pre
            return self.model.compute_logits(self.model.forward(input_ids, meta.positions, self.runner.kv_caches, meta))
        finally:
            self.kv.free(req)

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": self.kv.usage(),
            "prefix_cache_queries": self.kv.queries,
            "prefix_cache_hits": self.kv.hits,
            "preemptions": self.scheduler.num_preemptions,
            **({"spec_decode": self.spec.stats()} if self.spec is not None else {}),
            **({"kv_tiers": self.tiers.stats()} if self.tiers is not None else {}),
            **(self.rebuild.stats() if self.rebuild is not None else {}),
        }


def _state_rebuild(config: EngineConfig, layout, state: StateKVSlots, kv_caches) -> StateRebuild:
    """The engine's state-KV rebuild (replay mode, window cache) from its options."""
    cache = None
    if config.window_cache_seconds > 0 and config.enable_prefix_caching:  # entries are keyed by prefix hashes
        cache = WindowCache(state_tensors(kv_caches), config.window_cache_seconds, int(config.window_cache_gib * 2**30))
        state.on_release = cache.release
    return StateRebuild(
        state,
        config.block_size,
        layout.exact_replay_tokens,
        config.swa_replay,
        config.swa_replay_keep,
        layout.min_replay_tokens,
        cache,
    )


def _params_copy(params) -> SamplingParams:
    """The engine's own re-validated copy of a request's params."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return params.checked()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _cpu_note(device_type: str) -> str:
    if device_type != "cpu":
        return ""
    from ..builtin.cpu_features import cpu_features

    return f"; cpu {cpu_features().describe()}"


def _device_index(device: str) -> int | None:
    _, _, idx = device.partition(":")
    return int(idx) if idx else None


def _config_eos(config: dict) -> list[int]:
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]
