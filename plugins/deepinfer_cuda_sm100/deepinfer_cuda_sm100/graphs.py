"""CUDA graphs for decode steps, one per batch-size bucket, captured when the engine starts.

Each bucket's graph runs the model's forward over static input buffers (token ids, positions,
slots, sequence lengths, block tables sized for ``max_model_len``). A step of ``n`` requests
replays the smallest bucket ``>= n``: the real rows are copied in, padded rows get token 0 at
position 0 whose K/V goes to the engine's scratch block, and the first ``n`` output rows are
returned. All buckets share one memory pool, captured largest first, so the graphs together
cost about one largest step's activations. Prefill and mixed steps are not offered here.

Buckets of up to ``HEAD_ROWS`` requests also capture the LM head and the greedy argmax
(:meth:`CudaDecodeGraphs.run_logits`): at one request the eager head, its cast and the argmax
after the replay were ~0.19 ms of a 1.17 ms step (benchmarks/README.md). Larger buckets leave the
head to the engine: their float32 logits would stay allocated per bucket (256 rows x 129,280
is 132 MB) while the launches saved no longer matter next to the step.
"""

from __future__ import annotations

import logging
import time

import torch

from deepinfer_core.attention import AttentionMetadata

from .decode_capture import HEAD_ROWS, StaticInputs, bucket_sizes, capture_buckets, foreign_kernels, smallest_bucket

log = logging.getLogger(__name__)

#: the context every row of an idle replay attends over (replay_idle; a chat turn's order of size)
IDLE_CONTEXT = 256


class CudaDecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        scratch_block: int,
        max_num_seqs: int,
        max_blocks: int,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.max_blocks = block_size, max_blocks
        self.scratch_slot = scratch_block * block_size
        self.buckets = bucket_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.v4 = None  # DeepSeek-V4's own graphs (v4_graphs.py), which this object's run hands steps to
        if not all(isinstance(c, torch.Tensor) for c in kv_caches):  # e.g. DeepSeek-V4's per-request state KV
            if hasattr(model, "forward_decode"):
                from .v4_graphs import V4DecodeGraphs

                self.v4 = V4DecodeGraphs(
                    model,
                    kv_caches,
                    block_size=block_size,
                    scratch_block=scratch_block,
                    max_num_seqs=max_num_seqs,
                    max_blocks=max_blocks,
                )
                return
            log.info("decode steps run eagerly: this model's KV cache layout is not captured in CUDA graphs")
            return
        self.inputs = StaticInputs(
            self.buckets[-1], max_blocks, block_size=block_size, scratch_block=scratch_block, device=kv_caches[0].device
        )
        self.outputs: dict[int, torch.Tensor] = {}
        self.pres: dict[int, torch.Tensor] = {}  # bucket -> the pre-norm hidden states (models with forward_hidden)
        self.heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (logits, greedy ids)
        blockers = uncapturable(model)
        if blockers:  # e.g. the builtin MoE reads expert counts back to the host: stay eager
            log.info("decode steps run eagerly: %s cannot be captured in a CUDA graph", ", ".join(blockers))
        else:
            self._capture_all()

    def _step(self, n: int) -> torch.Tensor:
        args = (self.inputs.input_ids[:n], self.inputs.positions[:n], self.kv_caches, self.inputs.meta(n))
        if not hasattr(self.model, "forward_hidden"):
            return self.model.forward(*args)
        # the same layers, keeping the last one's output before the final norm (a drafter's input:
        # run_hidden); the capture's pair is what a replay refills
        hidden, self.pres[n] = self.model.forward_hidden(*args)
        return hidden

    def _head(self, n: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The same ops the engine and its sampler would run on these rows, where bucket ``n`` has them."""
        from .kernels.argmax import argmax_rows

        if n > HEAD_ROWS or not hasattr(self.model, "compute_logits"):  # HEAD_ROWS read now: a benchmark sets it
            return None
        logits = self.model.compute_logits(hidden)
        return logits, argmax_rows(logits)  # = torch.argmax, in 2 short launches

    def _capture_all(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        self.graphs, self.outputs, self.heads = capture_buckets(self.buckets, self._step, self._head)
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
            len(self.graphs),
            ",".join(map(str, self.buckets)),
            time.perf_counter() - start,
            (torch.cuda.memory_allocated() - before) / 2**20,
        )

    def capture_draft(self, fn, example: tuple[torch.Tensor, ...]):
        """A speculative drafter's proposal in graphs per batch bucket (``draft_graphs``)."""
        from .draft_graphs import capture_draft

        return capture_draft(fn, example)

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        if self.v4 is not None:
            return self.v4.run(input_ids, meta)
        bucket = self._bucket(meta)
        if bucket is None:
            return None
        self._replay(bucket, input_ids, meta)
        return self.outputs[bucket][: meta.num_requests]

    def run_hidden(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(hidden [N, D], the last layer's output before the final norm [N, D])`` of a decode
        step (a speculative step whose drafter reads the target's hidden: its verify steps run as
        decode rows), or None. The pre-norm rows are a copy: the drafter reads them after the
        bucket's next replay may have begun. DeepSeek-V4: its streams [N, hc, D] (v4_graphs)."""
        if self.v4 is not None:
            return self.v4.run_hidden(input_ids, meta)
        bucket = self._bucket(meta)
        if bucket is None or bucket not in self.pres:
            return None
        self._replay(bucket, input_ids, meta)
        n = meta.num_requests
        return self.outputs[bucket][:n], self.pres[bucket][:n].clone()

    def run_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(logits [N, V] float32, greedy ids [N] int64)`` of a decode step whose bucket
        captured the LM head, or None (then :meth:`run` may still take the step). The ids are a
        copy: the bucket's buffers are overwritten by its next replay, while the engine may still
        feed these ids to the next step and copy them back."""
        if self.v4 is not None:
            return self.v4.run_logits(input_ids, meta)
        bucket = self._bucket(meta)
        if bucket is None or bucket not in self.heads:
            return None
        self._replay(bucket, input_ids, meta)
        logits, ids = self.heads[bucket]
        n = meta.num_requests
        return logits[:n], ids[:n].clone()

    def run_logits_hidden(
        self, input_ids: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """:meth:`run_logits`' pair and :meth:`run_hidden`'s pre-norm rows from one replay (a
        speculative engine's decode step keeps the LM head in the graph), or None."""
        if self.v4 is not None:
            return self.v4.run_logits_hidden(input_ids, meta)
        bucket = self._bucket(meta)
        if bucket is None or bucket not in self.heads or bucket not in self.pres:
            return None
        self._replay(bucket, input_ids, meta)
        logits, ids = self.heads[bucket]
        n = meta.num_requests
        return logits[:n], ids[:n].clone(), self.pres[bucket][:n].clone()

    def replay_idle(self, rows: int) -> bool:
        """Replay the smallest bucket of at least ``rows`` rows with every row a padding row
        (:meth:`_fill_idle`: nothing of any request is read or written), for timing what a
        decode or decode-rows verify step of that many rows costs (DSpark's start-up curve);
        False where no captured bucket holds them (DeepSeek-V4's graphs: its padding repeats a
        live row's state, so it is not replayed idle). Asynchronous, as a step's replay is."""
        if self.v4 is not None or not self.graphs or rows > self.buckets[-1]:
            return False
        bucket = smallest_bucket(self.buckets, rows)
        self._fill_idle(bucket)
        self.graphs[bucket].replay()
        return True

    def _fill_idle(self, bucket: int) -> None:
        """Every row of ``bucket`` a padding row with a context of :data:`IDLE_CONTEXT` tokens
        (fewer where the tables are narrower: at most ``(max_blocks - 1) * block_size + 1``, a
        position below the engine's ``max_model_len``, which ``max_blocks`` covers rounded up),
        its whole block table the scratch block: the attention reads that many positions and the
        step writes one position of the scratch block a row."""
        ctx = min(IDLE_CONTEXT, (self.max_blocks - 1) * self.block_size + 1)
        inputs = self.inputs
        inputs.input_ids[:bucket].zero_()
        inputs.positions[:bucket].fill_(ctx - 1)
        inputs.slots[:bucket].fill_(self.scratch_slot + (ctx - 1) % self.block_size)
        inputs.seq_lens[:bucket].fill_(ctx)
        inputs.tables[:bucket].fill_(self.scratch_slot // self.block_size)

    def _bucket(self, meta: AttentionMetadata) -> int | None:
        n = meta.num_requests
        width = meta.block_tables.shape[1]
        if (
            not self.graphs
            or meta.max_query_len != 1
            or meta.batch_invariant
            or getattr(meta, "state_slots", None) is not None
            or n > self.buckets[-1]
            or width > self.max_blocks
        ):
            return None
        return smallest_bucket(self.buckets, n)

    def _replay(self, bucket: int, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        self._fill(bucket, input_ids, meta)
        self.graphs[bucket].replay()

    def _fill(self, bucket: int, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        n = meta.num_requests
        inputs = self.inputs
        inputs.copy_rows(input_ids, meta)
        if bucket > n:  # padded rows: one token at position 0 in the scratch block
            inputs.input_ids[n:bucket].zero_()
            inputs.positions[n:bucket].zero_()
            inputs.slots[n:bucket].fill_(self.scratch_slot)
            inputs.seq_lens[n:bucket].fill_(1)
            inputs.tables[n:bucket, 0].fill_(self.scratch_slot // self.block_size)


def uncapturable(model) -> list[str]:
    """Names of the model's attention backends / MoE dispatchers that are not this plugin's
    capture-safe kernels (ones that synchronise with the host, like the builtin MoE's counts)."""
    from .attention import TritonAttention

    return foreign_kernels(model, TritonAttention)
