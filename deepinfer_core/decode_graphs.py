"""Decode-step graph capture: the protocol a platform plugin implements (``deepinfer_decode_graphs``).

A decode step is the same few hundred kernels every time, with only the batch's values
changing; replaying a captured graph removes the host's per-kernel launch cost. The engine stays
device-neutral: it reserves a scratch KV block for padded rows and offers each pure-decode step
to the :class:`DecodeGraphs` object, which may decline (then the step runs eagerly).
"""

from __future__ import annotations

__all__ = ["DecodeGraphs", "DecodeGraphsFactory"]

from typing import Callable, Protocol, runtime_checkable

import torch

from .attention import AttentionMetadata


@runtime_checkable
class DecodeGraphs(Protocol):
    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states ``[T, D]`` of one decode step (one new token per request, each
        request's K/V written like an eager forward), or None to have it run eagerly."""
        ...


# Optional, beside ``run``: ``run_logits(input_ids, meta) -> (logits [N, V] float32, ids [N]) |
# None`` replays the step with the model's ``compute_logits`` and the argmax of its rows (ties
# to the lowest index, as ``torch.argmax``) captured too; the engine then takes ``ids`` as the
# tokens of rows its own sampler would sample greedily (no penalties, processors or banned
# tokens) and samples the others from ``logits``. None: the engine calls ``run`` (or the eager
# forward) as before.
#
# Optional too: ``run_hidden(input_ids, meta) -> (hidden [T, D], pre [T, D]) | None``, the step
# and the last layer's output before the final norm (the model's ``forward_hidden``), for a
# speculative drafter that reads the target's hidden state. None: the engine runs
# ``forward_hidden`` eagerly. A speculative verify step of a model with ``verify_as_decode_rows``
# arrives here as decode rows (one per token), so the captured buckets serve it too.
#
# Optional too: ``run_logits_hidden(input_ids, meta) -> (logits, ids, pre) | None``: both at once
# (``run_logits``' pair and ``run_hidden``'s ``pre``), so a speculative engine's decode steps keep
# the LM head and argmax inside the replay as a plain engine's do. None: ``run_hidden``.
#
# Optional too: ``replay_idle(rows) -> bool`` replays the captured step of the smallest bucket
# holding ``rows`` rows with every row a padding row (reading and writing the scratch block only),
# asynchronously; False where there is none. The engine times it for speculative decoding's
# steps-per-second curve (DSpark), so the curve is what a replayed step costs, not an eager forward.
#
# Optional too: ``capture_draft(fn, example) -> replay | None`` captures a speculative drafter's
# proposal: ``fn(*inputs)`` is a pure tensor function of row-independent inputs (``example``: one
# tensor per input, ``[max_rows, ...]``, valid values) returning a tuple of ``[rows, ...]``
# tensors; ``replay(*inputs)`` gives the same tuple for any ``rows <= max_rows`` (fresh tensors)
# from a graph per batch bucket, or None for more rows. The engine offers it to a drafter with
# ``use_graphs(capture_draft, max_rows, num_tokens)`` (the learned head: its whole chain of
# ``num_tokens`` steps, ~100 launches each, becomes one replay).


# factory(model, kv_caches, *, block_size, scratch_block, max_num_seqs, max_blocks) -> DecodeGraphs
DecodeGraphsFactory = Callable[..., DecodeGraphs]
