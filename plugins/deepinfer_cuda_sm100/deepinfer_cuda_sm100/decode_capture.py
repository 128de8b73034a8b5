"""What the paged models' and DeepSeek-V4's decode graphs (:mod:`.graphs`, :mod:`.v4_graphs`)
share: the batch-size buckets, the static input buffers a captured step reads, the capture of one
graph per bucket, and the check for kernels that cannot be captured.

Padding is deliberately not here: the two differ in what a padded row of a bucket is (paged
models: token 0 at position 0 writing to the scratch block; V4: a copy of row 0, because its
state rings have no scratch slot), so each caller fills its padded rows itself.
"""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer_core.attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
HEAD_ROWS = 64  # buckets up to here replay the LM head and the greedy argmax too (graphs.py, v4_graphs.py)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The buckets below ``max_num_seqs``, and ``max_num_seqs`` itself (the engine's largest step)."""
    return sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs})


def smallest_bucket(buckets: list[int], n: int) -> int:
    """The bucket a step of ``n`` rows replays (``n`` at most the largest bucket)."""
    return next(b for b in buckets if b >= n)


class StaticInputs:
    """The tensors a captured decode step reads, one row per request of the largest bucket;
    a replay copies the step's rows in and leaves the buffers where they are. ``state_slots``:
    also hold each row's state-KV slot (DeepSeek-V4); then ``slots`` are never written (V4
    layers write no paged KV) and keep pointing at the scratch block."""

    def __init__(
        self,
        rows: int,
        max_blocks: int,
        *,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        state_slots: bool = False,
    ) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks
        self.scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.tables = torch.full((rows, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.state_slots = torch.zeros(rows, dtype=torch.long, device=device) if state_slots else None

    def meta(self, n: int) -> AttentionMetadata:
        """Metadata over the first ``n`` rows (one token each, contexts up to the tables' width)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1], seq_lens=self.seq_lens[:n], positions=self.positions[:n],
            slot_mapping=self.slots[:n], block_tables=self.tables[:n], block_size=self.block_size,
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
            state_slots=None if self.state_slots is None else self.state_slots[:n],
        )  # fmt: skip

    def copy_rows(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a step's ``meta.num_requests`` rows into the first rows (padding is the caller's)."""
        n = meta.num_requests
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        if self.state_slots is None:
            self.slots[:n].copy_(meta.slot_mapping)
        else:
            self.state_slots[:n].copy_(meta.state_slots)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)


Head = Callable[[int, torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]


@torch.inference_mode()
def capture_buckets(buckets: list[int], step: Callable[[int], torch.Tensor], head: Head) -> tuple[dict, dict, dict]:
    """One CUDA graph per bucket, largest first into one memory pool (the graphs together cost
    about one largest step's activations). ``step(n)``: the hidden states ``[n, D]`` over the
    first ``n`` static rows; ``head(n, hidden)``: ``(logits, greedy ids)`` of those rows where
    bucket ``n`` replays the LM head too, else None. Each bucket runs once eagerly first
    (Triton compiles, allocator warm-up). Returns (graphs, outputs, heads), keyed by bucket."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for n in sorted(buckets, reverse=True):
            head(n, step(n))  # compile / warm up
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls other threads make meanwhile (another engine's KV-store
            # copies, a server's host work) neither break this capture nor fail themselves; the
            # default ("global") lets any thread's synchronising call invalidate it
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                outputs[n] = step(n)
                pair = head(n, outputs[n])
                if pair is not None:
                    heads[n] = pair
            graphs[n] = graph
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graphs, outputs, heads


def foreign_kernels(model, attention_type: type) -> list[str]:
    """Names of the model's attention backends that are not ``attention_type`` and of its MoE
    dispatchers that are not this plugin's: ones that may synchronise with the host (the builtin
    MoE reads expert counts back), which a graph capture refuses."""
    from .moe import TritonMoEDispatcher

    names = set()
    for module in model.modules():
        backend, dispatcher = getattr(module, "backend", None), getattr(module, "dispatcher", None)
        if backend is not None and not isinstance(backend, attention_type):
            names.add(getattr(backend, "name", type(backend).__name__))
        if dispatcher is not None and not isinstance(dispatcher, TritonMoEDispatcher):
            names.add(getattr(dispatcher, "name", type(dispatcher).__name__))
    return sorted(names)
