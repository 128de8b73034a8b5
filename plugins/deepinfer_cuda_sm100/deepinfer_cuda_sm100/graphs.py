"""CUDA graphs for decode steps, one per batch-size bucket, captured when the engine starts.

Each bucket's graph runs the model's forward over static input buffers (token ids, positions,
slots, sequence lengths, block tables sized for ``max_model_len``). A step of ``n`` requests
replays the smallest bucket ``>= n``: the real rows are copied in, padded rows get token 0 at
position 0 whose K/V goes to the engine's scratch block, and the first ``n`` output rows are
returned. All buckets share one memory pool, captured largest first, so the graphs together
cost about one largest step's activations. Prefill and mixed steps are not offered here.
"""
from __future__ import annotations

import logging
import time

import torch

from deepinfer_core.attention import AttentionMetadata

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


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
        start = time.perf_counter()
        before = torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for n in reversed(self.buckets):
                meta = self._meta(n)
                self.model.forward(self.input_ids[:n], self.positions[:n], self.kv_caches, meta)  # compile / warm up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[n] = self.model.forward(self.input_ids[:n], self.positions[:n], self.kv_caches, meta)
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
        n = meta.num_requests
        width = meta.block_tables.shape[1]
        if not self.graphs or meta.max_query_len != 1 or meta.batch_invariant or getattr(meta, "state_slots", None) is not None or n > self.buckets[-1] or width > self.max_blocks:
            return None
        bucket = next(b for b in self.buckets if b >= n)
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
        return self.outputs[bucket][:n]


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
