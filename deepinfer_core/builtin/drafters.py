"""Builtin drafters for speculative decoding (registered in :mod:`.catalogues`).

``ngram``: prompt lookup, model-free. The longest suffix of the request's history (up to
``prompt_lookup_max`` tokens, at least ``prompt_lookup_min``) that occurred before is looked up
and the tokens that followed its latest earlier occurrence are proposed. Its confidence for
draft k is the empirical rate at which draft k, proposed from a match of that length, equalled
the token the target then produced, counted online from the request histories themselves (the
next proposal sees what was committed after the previous one), with a Beta(1, 1) prior.

``mtp``: DeepSeek-V4's multi-token-prediction block(s), chained for γ > 1 (see :class:`MTPDrafter`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention import AttentionMetadata
from ..speculative import DraftBatch, DrafterContext

__all__ = ["MTPDrafter", "NgramDrafter", "mtp_drafter", "ngram_drafter"]


class _SuffixIndex:
    """One request's n-grams (``min_n`` .. ``max_n`` tokens) -> the end position of their latest
    occurrence that something follows, grown by the tokens committed since the last call: a
    lookup costs O(max_n) and the history is indexed once (scanning it at every proposal cost
    ~90 us a request on a 200-token history, 5.6 ms a 64-request step on an H100)."""

    __slots__ = ("min_n", "max_n", "ends", "done")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.done = 0  # end positions 0 .. done - 1 are indexed

    def match(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        L = len(tokens)
        if L - 1 < self.done:  # a shorter history than indexed (not one request's growth): start over
            self.ends.clear()
            self.done = 0
        ends = self.ends
        for e in range(self.done, L - 1):  # an n-gram ending at e <= L - 2 has a token after it
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                ends[tuple(tokens[e - n + 1 : e + 1])] = e
        self.done = max(self.done, L - 1)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            e = ends.get(tuple(tokens[L - n :]))
            if e is not None:
                return n, list(tokens[e + 1 : e + 1 + k])
        return 0, []


class NgramDrafter:
    name = "ngram"
    needs_token_ids = True

    def __init__(self, min_n: int = 1, max_n: int = 4, gamma: int = 5) -> None:
        self.min_n, self.max_n = min_n, max_n
        # [match length, draft index] -> (matched the target, proposed), counted online
        self.hits = np.zeros((max_n + 1, gamma), np.int64)
        self.seen = np.zeros((max_n + 1, gamma), np.int64)
        self._last: dict[str, tuple[int, int, list[int]]] = {}  # request id -> (position, match length, drafts)
        self._index: dict[str, _SuffixIndex] = {}  # request id -> its n-grams' latest occurrences

    def _learn(self, request_id: str, tokens: list[int]) -> None:
        prev = self._last.pop(request_id, None)
        if prev is None:
            return
        pos, n, drafts = prev
        new = tokens[pos + 1 :]  # committed since that proposal: accepted drafts + the target's token
        for j, d in enumerate(drafts[: len(new)]):
            self.seen[n, j] += 1
            if d != new[j]:
                break
            self.hits[n, j] += 1

    def _match(self, request_id: str, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(match length, up to k continuation tokens) of the longest suffix seen before."""
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = _SuffixIndex(self.min_n, self.max_n)
        return index.match(tokens, k)

    def propose(self, batch: DraftBatch, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        R = len(batch.request_ids)
        ids = np.zeros((R, num_tokens), np.int64)
        conf = np.zeros((R, num_tokens), np.float32)
        if num_tokens > self.seen.shape[1]:
            grow = num_tokens - self.seen.shape[1]
            self.hits = np.pad(self.hits, ((0, 0), (0, grow)))
            self.seen = np.pad(self.seen, ((0, 0), (0, grow)))
        rate = (self.hits + 1) / (self.seen + 2)  # P(draft k matches | drafts < k did), per match length
        for r, (request_id, tokens) in enumerate(zip(batch.request_ids, batch.token_ids)):
            self._learn(request_id, tokens)
            n, drafts = self._match(request_id, tokens, num_tokens)
            if not drafts:
                continue
            ids[r, : len(drafts)] = drafts
            conf[r, : len(drafts)] = rate[n, : len(drafts)]
            self._last[request_id] = (len(tokens) - 1, n, drafts)
        return torch.from_numpy(ids).to(batch.last_token_ids.device), torch.from_numpy(conf).to(
            batch.last_token_ids.device
        )

    def release(self, request_id: str) -> None:
        self._last.pop(request_id, None)
        self._index.pop(request_id, None)


def ngram_drafter(config: dict, ctx: DrafterContext | None = None) -> NgramDrafter:
    return NgramDrafter(
        config.get("prompt_lookup_min", 1), config.get("prompt_lookup_max", 4), config.get("num_speculative_tokens", 5)
    )


class MTPDrafter:
    """DeepSeek-V3 / V4 MTP drafting: block ``j mod num_blocks`` maps (the hidden state at
    position p -- V4: its hyper-connection streams --, token p + 1) to logits for p + 2 and the
    hidden state it feeds the next link of the chain.

    Its cache: each call runs the chain for every request in a scratch cache of its own that
    holds only this call's drafted span (positions shifted to start at 0; RoPE is relative), so
    the MTP block attends to the tokens it drafts in this call, not to the whole history; the
    draft quality of a released checkpoint is lower than with a full-history MTP cache (not
    built yet), and exactness never depends on it. Confidence = the block's softmax probability
    of its own draft (an uncalibrated proxy; calibration is measured by the benchmark)."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, model, gamma: int, max_rows: int, device) -> None:
        if getattr(model, "mtp", None) is None or not hasattr(model, "mtp_forward"):
            reason = getattr(model, "mtp_unavailable", None) or f"{type(model).__name__} has no MTP block"
            raise ValueError(f"speculative_config: method 'mtp' needs a model with an MTP block: {reason}")
        self.model = model
        self.gamma = gamma
        self.num_blocks = len(model.mtp)
        ratios = [r for r in getattr(getattr(model, "cfg", None), "compress_ratios", ()) if r] or [1]
        lcm = int(np.lcm.reduce(np.array(ratios, np.int64)))
        self.block_size = lcm * -(-(gamma + 1) // lcm)  # the drafted span in one block, ratios dividing it
        self.layout = model.mtp_kv_layout(self.block_size)
        self.max_rows = max_rows
        self.caches = None
        self.device = device

    def _caches(self, rows: int):
        if self.caches is None or rows > self.max_rows:
            self.max_rows = max(rows, self.max_rows)
            self.caches = self.layout.allocate(self.max_rows, self.max_rows, self.device)
        return self.caches

    @torch.inference_mode()
    def propose(self, batch: DraftBatch, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        streams, token = batch.hidden, batch.last_token_ids
        R = token.shape[0]
        caches = self._caches(R)
        dev = token.device
        rows = torch.arange(R, device=dev)
        ids, conf = [], []
        for j in range(num_tokens):
            meta = AttentionMetadata(
                query_start_loc=torch.arange(R + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.full((R,), j + 1, dtype=torch.int32, device=dev),
                positions=torch.full((R,), j, dtype=torch.long, device=dev),
                slot_mapping=rows * self.block_size + j,
                block_tables=rows.to(torch.int32)[:, None],
                block_size=self.block_size,
                max_query_len=1,
                max_seq_len=j + 1,
                state_slots=rows,
                prompt_lens=(0,) * R,
                host_query_start_loc=tuple(range(R + 1)),
                host_seq_lens=(j + 1,) * R,
                host_state_slots=tuple(range(R)),
            )
            block = j % self.num_blocks
            logits, streams = self.model.mtp_forward(streams, token, meta.positions, caches[block], meta, block)
            probs = torch.softmax(logits.float(), dim=-1)
            p, token = probs.max(dim=-1)
            ids.append(token)
            conf.append(p)
        return torch.stack(ids, 1), torch.stack(conf, 1)


def mtp_drafter(config: dict, ctx: DrafterContext) -> MTPDrafter:
    return MTPDrafter(ctx.model, config.get("num_speculative_tokens", 5), 8, ctx.device)
