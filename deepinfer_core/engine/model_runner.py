"""Runs one scheduled step: builds the flat batch, runs the model, samples.

The model sees only tensors: input ids and positions of every scheduled token, and an
:class:`AttentionMetadata` (cumulative query lengths, sequence lengths, block tables, slot
mapping). Nothing per request crosses into the forward as a Python list.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from ..attention import AttentionMetadata
from ..decode_graphs import DecodeGraphs
from ..models import CausalLM
from ..parallel.load import ExpertLoadCounter
from ..staging import staging_for
from .batch_build import Batch, build
from .isolation import sample_isolated
from .sampler import ALL_MASKED, Sampler, SamplingRow, invalid_token_message
from .scheduler import SchedulerOutput


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, int]  # request id -> new token, for requests that reached their end
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its row could not be sampled
    # speculative verify rows: request id -> accepted drafts + the correction or bonus token
    verified: dict[str, list[int]] = field(default_factory=dict)
    # ModelRunner.keep_hidden: the target's pre-norm hidden at the sampled rows ([S, D] or [S, hc, D])
    # and, per request, the row that produced its newest token
    hidden: torch.Tensor | None = None
    hidden_row: dict[str, int] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        batch_invariant: bool = False,
        state=None,
    ) -> None:
        self.model = model
        self.state = state  # StateKVSlots when the model keeps per-request state KV
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.batch_invariant = batch_invariant
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None  # set by the engine when the platform captures decode steps
        self.invariant_ops: Callable[[], ContextManager] | None = None  # deepinfer_batch_invariant_ops
        self.expert_load: ExpertLoadCounter | None = None  # set by the engine: its windows advance per step
        self.keep_hidden = False  # a drafter reads the target's hidden states (model.forward_hidden)
        # verify steps laid out as decode rows (batch_build.build): the model's attention reads only the paged cache
        self.verify_as_decode_rows = bool(getattr(model, "verify_as_decode_rows", False)) and state is None

    def build_batch(
        self, out: SchedulerOutput, replay: bool = False
    ) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled requests. Returns (input_ids [T], metadata, sample row indices)."""
        batch = self._build(out, replay)
        return batch.input_ids, batch.meta, batch.sample_rows

    def _build(self, out: SchedulerOutput, replay: bool = False, input_ids: torch.Tensor | None = None) -> Batch:
        slots = None if self.state is None else [self.state.slot(s.request_id) for s in out.requests]
        return build(
            out,
            self.block_size,
            self.device,
            batch_invariant=self.batch_invariant,
            state_slots=slots,
            replay=replay,
            input_ids=input_ids,
            verify_as_decode_rows=self.verify_as_decode_rows and not replay,
        )

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, rows: dict[str, SamplingRow], replay: SchedulerOutput | None = None
    ) -> RunnerOutput:
        return self.collect(self.launch(out, rows, replay))

    @torch.inference_mode()
    def launch(
        self,
        out: SchedulerOutput,
        rows: dict[str, SamplingRow],
        replay: SchedulerOutput | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> Launched:
        """Queue the step's forward and sampling on the device and the copy of the sampled ids
        back to the host; return without waiting for them (:meth:`collect` waits).
        ``input_ids`` (device ids, one per scheduled token) stands in for tokens still pending."""
        if not out.requests:
            return Launched(out, (), None, None, None, RunnerOutput({}))
        if self.expert_load is not None:
            self.expert_load.step()
        if replay is not None:  # rebuild state KV of requests resuming past a prefix hit first
            rb = self._build(replay, replay=True)
            self.model.forward(rb.input_ids, rb.meta.positions, self.kv_caches, rb.meta)
        batch = self._build(out, input_ids=input_ids)
        with self.invariant_ops() if self.invariant_ops is not None else nullcontext():
            return self._forward_and_sample(out, rows, batch, input_ids)

    def collect(self, launched: Launched) -> RunnerOutput:
        """Wait for a launched step's sampled ids and check them (one host copy per step)."""
        if launched.result is not None:
            return launched.result
        if launched.ready is not None:
            launched.ready.synchronize()
        tokens = launched.host.tolist()
        if launched.staged is not None:  # read: the buffer may take the next step's ids
            staging_for(launched.tokens.device).release(launched.staged)
        if launched.verifying:
            return _verified(launched, tokens)
        sampled, failed = {}, {}
        for request_id, token in zip(launched.request_ids, tokens):
            if 0 <= token < launched.vocab:
                sampled[request_id] = token
            else:  # ALL_MASKED: nothing was allowed (see the sampler)
                failed[request_id] = invalid_token_message(token, launched.vocab)
        if launched.pre_hidden is not None:
            rows = {request_id: i for i, request_id in enumerate(launched.request_ids)}
            return RunnerOutput(sampled, failed, hidden=launched.pre_hidden, hidden_row=rows)
        return RunnerOutput(sampled, failed)

    def _forward_and_sample(
        self, out: SchedulerOutput, rows: dict[str, SamplingRow], batch: Batch, fed: torch.Tensor | None
    ) -> Launched:
        input_ids, meta = batch.input_ids, batch.meta
        hidden = logits = greedy = pre = None
        verifying = any(s.num_spec for s in out.requests)
        decode_shaped = meta.max_query_len == 1 and input_ids.shape[0] == meta.num_requests
        if self.keep_hidden:  # the drafter reads the pre-norm hidden states: a graph that keeps them, or the layers
            with_all = getattr(self.graphs, "run_logits_hidden", None) if decode_shaped else None
            if with_all is not None and batch.sample_index is None and batch.sample_rows:
                got = with_all(input_ids, meta)  # the LM head and argmax in the replay too, as run_logits
                if got is not None:
                    logits, greedy, pre = got
            if logits is None:
                with_pre = getattr(self.graphs, "run_hidden", None) if decode_shaped else None
                got = with_pre(input_ids, meta) if with_pre is not None else None
                hidden, pre = (
                    got
                    if got is not None
                    else self.model.forward_hidden(input_ids, meta.positions, self.kv_caches, meta)
                )
        elif self.graphs is not None and decode_shaped:
            with_head = getattr(self.graphs, "run_logits", None)  # the LM head and argmax captured too
            got = (
                with_head(input_ids, meta)
                if with_head is not None and batch.sample_index is None and batch.sample_rows
                else None
            )
            if got is not None:
                logits, greedy = got
            else:
                hidden = self.graphs.run(input_ids, meta)  # a captured decode step, or None
        if hidden is None and logits is None:
            hidden = self.model.forward(input_ids, meta.positions, self.kv_caches, meta)  # [T, D]
        if not batch.sample_rows:
            return Launched(out, (), None, None, None, RunnerOutput({}), fed)
        if pre is not None:
            pre = pre if batch.sample_index is None else pre[batch.sample_index]
        if verifying:  # one id per sampled row: a verify request's id once per verified position
            ids = tuple(s.request_id for s in out.requests if s.sample for _ in range(s.num_spec + 1))
        else:
            ids = (
                out.columns.ids if out.columns is not None else tuple(s.request_id for s in out.requests if s.sample)
            )  # columns: every row samples
        if type(self.sampler) is Sampler and getattr(
            rows, "plain_greedy", False
        ):  # a continuation that knows, without reading the rows
            row_list, plain = None, True
        else:
            if verifying:  # rows[id]: a tuple of SamplingRows for a verify request, one per position
                row_list = [r for s in out.requests if s.sample for r in _as_rows(rows[s.request_id])]
            else:
                row_list = [rows[i] for i in ids]
            plain = type(self.sampler) is Sampler and all(
                _plain_greedy(r) for r in row_list
            )  # the sampler would return the argmax
        if logits is None:
            sample_hidden = hidden if batch.sample_index is None else hidden[batch.sample_index]
            fused = getattr(
                self.model, "greedy_tokens", None
            )  # the head's argmax without the logits (greedy rows only)
            if fused is not None and plain:
                if (got := fused(sample_hidden)) is not None:
                    host, ready, buf = _copy_back(got[0])
                    return Launched(out, ids, got[0], host, ready, None, fed, got[1], buf, pre, verifying)
            logits = self.model.compute_logits(sample_hidden)  # [N, V]
        on_device = getattr(self.sampler, "sample_device", None)  # a plain callable samples on the host
        try:  # penalties change the logits in place: keep them for the per-row retry
            if on_device is None:
                raise NotImplementedError
            if plain:  # the sampler's own argmax, already in the graph or taken here without its per-row passes
                tokens = greedy if greedy is not None else torch.argmax(logits.float(), dim=-1)
            else:
                tokens = on_device(logits.clone() if any(_mutates(r) for r in row_list) else logits, row_list)
        except Exception:  # find the rows at fault, sampling each alone (on the host's clock)
            if verifying:  # per position: a row after a rejected draft may fail harmlessly
                tokens = _sample_rows_alone(self.sampler, logits, row_list)
                return Launched(out, ids, tokens, tokens, None, None, fed, logits.shape[-1], None, pre, True)
            sampled, failed = sample_isolated(
                self.sampler, logits, ids, row_list if row_list is not None else [rows[i] for i in ids]
            )
            return Launched(out, ids, None, None, None, RunnerOutput(sampled, failed), fed)
        host, ready, buf = _copy_back(tokens)
        return Launched(out, ids, tokens, host, ready, None, fed, logits.shape[-1], buf, pre, verifying)


@dataclass(frozen=True)
class Launched:
    """A step whose device work is queued: what :meth:`ModelRunner.collect` needs to finish it,
    and what overlapped scheduling needs to build the next step before it finishes."""

    sched: SchedulerOutput
    request_ids: tuple[str, ...]  # the sampled rows, in order
    tokens: torch.Tensor | None  # [S] int64 sampled ids on the device (None: sampled on the host)
    host: torch.Tensor | None  # [S] host copy of ``tokens``, valid once ``ready`` has fired
    ready: object | None  # device event after the copy; None: ``host`` is valid now
    result: RunnerOutput | None  # set when the step is already finished on the host
    fed: torch.Tensor | None = None  # device ids that stood in for pending tokens (checked in debug)
    vocab: int = 0
    staged: torch.Tensor | None = None  # the pinned buffer under ``host``: back to the staging once read
    pre_hidden: torch.Tensor | None = None  # [S, ...] the target's pre-norm hidden at the sampled rows
    verifying: bool = False  # some request verifies drafts: request_ids repeat once per verified position


def _as_rows(row) -> tuple[SamplingRow, ...]:
    return row if isinstance(row, tuple) else (row,)


def _sample_rows_alone(sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row sampled on its own; a row whose sampling raises gets ALL_MASKED (it fails its
    request only if the verification reaches it)."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(int(sampler(logits[i : i + 1].clone(), [row])[0]))
        except Exception:
            out.append(ALL_MASKED)
    return torch.tensor(out, dtype=torch.long)


def _verified(launched: Launched, tokens: list[int]) -> RunnerOutput:
    """Accept each request's drafts while they equal the token the target's sampler drew at that
    position (seeded by request and position, as without drafts): for greedy rows the standard
    rule (draft == argmax), for sampled rows the standard rule for a deterministic draft (accepted
    with probability p(draft), else a token from p without it; speculative.rejection_sample).
    The output is the accepted drafts and the target's token at the first mismatch (or the bonus
    token after the last draft): token for token what decoding without drafts samples."""
    sampled, failed, verified, hidden_row = {}, {}, {}, {}
    i = 0
    vocab = launched.vocab
    for s in launched.sched.requests:
        if not s.sample:
            continue
        n = s.num_spec + 1
        drafts = s.token_ids[len(s.token_ids) - s.num_spec :] if s.num_spec else ()
        emitted = []
        for j in range(n):
            token = tokens[i + j]
            if not 0 <= token < vocab:
                failed[s.request_id] = invalid_token_message(token, vocab)
                break
            emitted.append(token)
            if j == n - 1 or token != drafts[j]:
                break
        if s.request_id not in failed:
            hidden_row[s.request_id] = i + len(emitted) - 1
            if s.num_spec:
                verified[s.request_id] = emitted
            else:
                sampled[s.request_id] = emitted[0]
        i += n
    return RunnerOutput(sampled, failed, verified, launched.pre_hidden, hidden_row)


def _mutates(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logits_processors)


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing that changes or masks the logits: the sampler returns their argmax."""
    return row.params.greedy and not _mutates(row) and not row.suppressed


def _copy_back(tokens: torch.Tensor) -> tuple[torch.Tensor, object | None, torch.Tensor | None]:
    """Start the one device-to-host copy of a step's sampled ids; (host tensor, event or None,
    the staging buffer :meth:`ModelRunner.collect` gives back once it has read the ids, or None)."""
    staging = staging_for(tokens.device)
    if staging is None:  # the CPU, or no pinned memory / events here
        return (tokens if tokens.device.type == "cpu" else tokens.cpu()), None, None
    host, buf = staging.readback_buffer(tokens.shape, tokens.dtype)
    host.copy_(tokens, non_blocking=True)
    ready = torch.Event(device=tokens.device)
    ready.record()
    return host, ready, buf
