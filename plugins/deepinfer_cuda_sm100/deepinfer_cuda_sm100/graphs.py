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

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
HEAD_ROWS = 64  # buckets up to here replay the LM head and the greedy argmax too


class CudaDecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], *, block_size: int, scratch_block: int, max_num_seqs: int, max_blocks: int) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.max_blocks = block_size, max_blocks
        self.scratch_slot = scratch_block * block_size
        self.buckets = sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.v4 = None  # DeepSeek-V4's own graphs (v4_graphs.py), which this object's run hands steps to
        if not all(isinstance(c, torch.Tensor) for c in kv_caches):  # e.g. DeepSeek-V4's per-request state KV
            if hasattr(model, "forward_decode"):
                from .v4_graphs import V4DecodeGraphs

                self.v4 = V4DecodeGraphs(model, kv_caches, block_size=block_size, scratch_block=scratch_block, max_num_seqs=max_num_seqs, max_blocks=max_blocks)
                return
            log.info("decode steps run eagerly: this model's KV cache layout is not captured in CUDA graphs")
            return
        dev = kv_caches[0].device
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), self.scratch_slot, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.tables = torch.full((top, max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.outputs: dict[int, torch.Tensor] = {}
        self.heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (logits, greedy ids)
        blockers = uncapturable(model)
        if blockers:  # e.g. the builtin MoE reads expert counts back to the host: stay eager
            log.info("decode steps run eagerly: %s cannot be captured in a CUDA graph", ", ".join(blockers))
        else:
            self._capture_all()

    def _meta(self, n: int) -> AttentionMetadata:
        """Metadata over the first ``n`` rows of the static buffers."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1], seq_lens=self.seq_lens[:n], positions=self.positions[:n],
            slot_mapping=self.slots[:n], block_tables=self.tables[:n], block_size=self.block_size,
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
        )  # fmt: skip

    @torch.inference_mode()
    def _capture_all(self) -> None:
        from .kernels.argmax import argmax_rows

        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for n in reversed(self.buckets):
                meta = self._meta(n)
                head = n <= HEAD_ROWS and hasattr(self.model, "compute_logits")
                warm = self.model.forward(self.input_ids[:n], self.positions[:n], self.kv_caches, meta)  # compile / warm up
                if head:
                    argmax_rows(self.model.compute_logits(warm))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[n] = self.model.forward(self.input_ids[:n], self.positions[:n], self.kv_caches, meta)
                    if head:  # the same ops the engine and its sampler would run on these rows
                        logits = self.model.compute_logits(self.outputs[n])
                        self.heads[n] = (logits, argmax_rows(logits))  # = torch.argmax, in 2 short launches
                self.graphs[n] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
            len(self.graphs), ",".join(map(str, self.buckets)), time.perf_counter() - start, (torch.cuda.memory_allocated() - before) / 2**20,
        )

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        if self.v4 is not None:
            return self.v4.run(input_ids, meta)
        bucket = self._bucket(meta)
        if bucket is None:
            return None
        self._replay(bucket, input_ids, meta)
        return self.outputs[bucket][: meta.num_requests]

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

    def _bucket(self, meta: AttentionMetadata) -> int | None:
        n = meta.num_requests
        width = meta.block_tables.shape[1]
        if not self.graphs or meta.max_query_len != 1 or meta.batch_invariant or getattr(meta, "state_slots", None) is not None or n > self.buckets[-1] or width > self.max_blocks:
            return None
        return next(b for b in self.buckets if b >= n)

    def _replay(self, bucket: int, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        n = meta.num_requests
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.tables[:n, :width].copy_(meta.block_tables)
        if bucket > n:  # padded rows: one token at position 0 in the scratch block
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slots[n:bucket].fill_(self.scratch_slot)
            self.seq_lens[n:bucket].fill_(1)
            self.tables[n:bucket, 0].fill_(self.scratch_slot // self.block_size)
        self.graphs[bucket].replay()


def uncapturable(model) -> list[str]:
    """Names of the model's attention backends / MoE dispatchers that are not this plugin's
    capture-safe kernels (ones that synchronise with the host, like the builtin MoE's counts)."""
    from .attention import TritonAttention
    from .moe import TritonMoEDispatcher

    names = set()
    for module in model.modules():
        backend, dispatcher = getattr(module, "backend", None), getattr(module, "dispatcher", None)
        if backend is not None and not isinstance(backend, TritonAttention):
            names.add(getattr(backend, "name", type(backend).__name__))
        if dispatcher is not None and not isinstance(dispatcher, TritonMoEDispatcher):
            names.add(getattr(dispatcher, "name", type(dispatcher).__name__))
    return sorted(names)
