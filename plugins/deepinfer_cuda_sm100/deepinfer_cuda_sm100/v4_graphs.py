"""CUDA graphs for DeepSeek-V4 decode steps, one per batch-size bucket (as :mod:`.graphs` for
paged models), over the model's fixed-shape step ``forward_decode``.

Besides ids, positions, sequence lengths and block tables, a V4 step reads each request's
state-KV slot (its window ring and compressor tails), so the static buffers hold slots too.
Padded rows of a bucket repeat row 0 (same token, position, slot and block table): they compute
and store exactly row 0's values, so no other request's state or blocks are touched and no
scratch state slot is needed. Capture runs the step on slot 0 at position 0 in the scratch
block before any request holds a slot. Buckets up to ``HEAD_ROWS`` (decode_capture) also replay the LM head
and the greedy argmax (``run_logits``), as graphs.py does for paged models.

``capture=False`` runs the same static-buffer step eagerly (no graph): how the tests check this
module's buffer handling on a machine without CUDA.
"""

from __future__ import annotations

import logging
import time

import torch

from deepinfer_core.attention import AttentionMetadata

from .decode_capture import HEAD_ROWS, StaticInputs, bucket_sizes, capture_buckets, foreign_kernels, smallest_bucket

log = logging.getLogger(__name__)


class V4DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches: list,
        *,
        block_size: int,
        scratch_block: int,
        max_num_seqs: int,
        max_blocks: int,
        capture: bool = True,
    ) -> None:
        self.model, self.kv_caches, self.capture = model, kv_caches, capture
        self.block_size, self.max_blocks = block_size, max_blocks
        self.buckets = bucket_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pres: dict[int, torch.Tensor] = {}  # bucket -> the last layer's streams (what the MTP drafter reads)
        self.heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (logits, greedy ids), as graphs.py
        self.enabled = False
        dev = kv_caches[0].window.device
        self.inputs = StaticInputs(
            self.buckets[-1],
            max_blocks,
            block_size=block_size,
            scratch_block=scratch_block,
            device=dev,
            state_slots=True,
        )
        blockers = v4_uncapturable(model)
        if capture and blockers:
            log.info("DeepSeek-V4 decode steps run eagerly: %s cannot be captured in a CUDA graph", ", ".join(blockers))
            return
        self.enabled = True
        if capture:
            self._capture_all()

    def _step(self, n: int) -> torch.Tensor:
        args = (self.inputs.input_ids[:n], self.inputs.positions[:n], self.kv_caches, self.inputs.meta(n))
        if not hasattr(self.model, "forward_decode_hidden"):
            return self.model.forward_decode(*args)
        # the same step, keeping the streams before hc_head (run_hidden): no extra kernel, the
        # capture's tensor is what a replay refills
        hidden, self.pres[n] = self.model.forward_decode_hidden(*args)
        return hidden

    def _head(self, n: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The LM head and the greedy argmax the engine would run on these rows, where bucket ``n`` has them."""
        if n > HEAD_ROWS:
            return None
        logits = self.model.compute_logits(hidden)
        return logits, torch.argmax(logits, dim=-1)

    def _capture_all(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        self.graphs, self.outputs, self.heads = capture_buckets(self.buckets, self._step, self._head)
        log.info(
            "captured %d DeepSeek-V4 decode CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
            len(self.graphs),
            ",".join(map(str, self.buckets)),
            time.perf_counter() - start,
            (torch.cuda.memory_allocated() - before) / 2**20,
        )

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        bucket = self._bucket(input_ids, meta)
        if bucket is None:
            return None
        n = meta.num_requests
        self._fill(bucket, input_ids, meta)
        if not self.capture:
            with torch.inference_mode():
                return self._step(bucket)[:n]
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]

    def run_hidden(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(hidden [N, D], the last layer's streams [N, hc, D])`` of a decode step (a
        speculative engine whose drafter reads the target's streams: MTP), or None
        (``DecodeGraphs.run_hidden``). The streams are a copy: the drafter reads them after the
        bucket's next replay may have begun."""
        bucket = self._bucket(input_ids, meta)
        if bucket is None or (self.capture and bucket not in self.pres):
            return None
        n = meta.num_requests
        self._fill(bucket, input_ids, meta)
        if not self.capture:
            with torch.inference_mode():
                hidden = self._step(bucket)
            return hidden[:n], self.pres[bucket][:n]
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n], self.pres[bucket][:n].clone()

    def run_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(logits [N, V] float32, greedy ids [N])`` where the bucket captured the LM head too
        (``DecodeGraphs.run_logits``; the ids a copy, as graphs.py returns them), else None."""
        bucket = self._bucket(input_ids, meta)
        if bucket is None or bucket not in self.heads:
            return None
        self._fill(bucket, input_ids, meta)
        self.graphs[bucket].replay()
        logits, ids = self.heads[bucket]
        n = meta.num_requests
        return logits[:n], ids[:n].clone()

    def run_logits_hidden(
        self, input_ids: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """:meth:`run_logits`' pair and :meth:`run_hidden`'s streams from one replay, or None."""
        bucket = self._bucket(input_ids, meta)
        if bucket is None or bucket not in self.heads or bucket not in self.pres:
            return None
        self._fill(bucket, input_ids, meta)
        self.graphs[bucket].replay()
        logits, ids = self.heads[bucket]
        n = meta.num_requests
        return logits[:n], ids[:n].clone(), self.pres[bucket][:n].clone()

    def _bucket(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> int | None:
        n = meta.num_requests
        width = meta.block_tables.shape[1]
        if (not self.enabled or meta.max_query_len != 1 or meta.batch_invariant or meta.replay
                or meta.state_slots is None or input_ids.shape[0] != n or n > self.buckets[-1]
                or width > self.max_blocks):  # fmt: skip
            return None
        return smallest_bucket(self.buckets, n)

    def _fill(self, bucket: int, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        n = meta.num_requests
        inputs = self.inputs
        inputs.copy_rows(input_ids, meta)
        if bucket > n:  # padded rows repeat row 0: they write row 0's own values to row 0's state
            for buf in (inputs.input_ids, inputs.positions, inputs.state_slots, inputs.seq_lens, inputs.tables):
                buf[n:bucket].copy_(buf[:1].expand_as(buf[n:bucket]))


def v4_uncapturable(model) -> list[str]:
    """Names of the model's V4 attention backends / MoE dispatchers that are not this plugin's
    capture-safe Triton ones (the builtin MoE reads expert counts back to the host)."""
    from .attention import TritonV4Attention

    return foreign_kernels(model, TritonV4Attention)
