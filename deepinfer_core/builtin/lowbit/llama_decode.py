"""One native call per decode step for a Llama-family model on the low-bit CPU path.

A decode step of SmolLM2-135M at one request cost ~40 ms of CPU, ~14 ms of it the dispatch of
~2,800 small torch ops around the GEMMs. :class:`LlamaDecodePlan` describes the model once (the
packed weights' pointers, norms, rotary tables, cache geometry) in ctypes structures, and each
step where every request feeds exactly one token runs ``llama_decode_step`` in ``layer.c``:
embedding, all decoder layers and the final norm, with the same GEMM and paged-attention
functions the torch path calls. Prefill, mixed and batch-invariant steps, replays, and models
this plan cannot describe keep the torch path. ``DEEPINFER_FUSED_DECODE=0`` turns the plan off
(the torch path, for debugging and side-by-side benchmarks).

Prefill and mixed steps take the same native call, one row per new token: each row carries its
request's block table and its own position, and a layer writes every row's key and value before
its attention reads any, so attention over positions ``0..position`` is causal prefill attention
(a prompt's earlier chunks are already in the cache). A call with prompt runs (several rows of one
request) attends with ``prefill_attention.c``: a request's rows share each key and value loaded,
and by default (:func:`prefill_attention_mode`) the call's own keys and values are read in float32
as computed, only earlier chunks' from the (half) cache, as the float32 model sees them. Rows go
in chunks of :data:`PREFILL_CHUNK` in token order: a later chunk reads the keys an earlier chunk
wrote, and the scratch stays small. The GEMMs compute a row alone (but for a last chunk of 1-4
rows, which the int16 GEMM sums in its rows layout: the same integers, float32 rounding in another
order; kernels_i16.c); where a chunk boundary falls inside a prompt, its later rows see the earlier
chunk's keys rounded to half. Contexts beyond :data:`PREFILL_MAX_CONTEXT` keep the torch path.
``DEEPINFER_NATIVE_PREFILL=0`` keeps every multi-token step on the torch path.
"""

from __future__ import annotations

import ctypes
import logging
import time

import torch
import torch.nn as nn

from ... import envs
from ...attention import AttentionMetadata
from ...lowbit.attention import CACHE_DTYPES, PagedDecodeAttention, kv_kind
from ...lowbit.formats import KIND_CODE, QuantWeight
from ...lowbit.modules import LowBitEmbedding, LowBitLinear
from ...lowbit.native import load
from ...lowbit.threads import ThreadChooser, adaptive_enabled
from ...models.layers import GatedMLP, RMSNorm
from ...models.llama.model import LlamaAttention, LlamaDecoderLayer

log = logging.getLogger(__name__)
ENV_SWITCH = "DEEPINFER_FUSED_DECODE"
PREFILL_SWITCH = "DEEPINFER_NATIVE_PREFILL"
PREFILL_ATTENTION_SWITCH = "DEEPINFER_PREFILL_ATTENTION"
PREFILL_ATTENTION_MODES = ("0", "1", "2")
PREFILL_CHUNK = 512  # rows per native call in a prefill step (the GEMMs run at ~96% of their 2,048-row speed)
# longest context a prefill step takes natively: measured ahead of the torch path up to 2,000
# (benchmarks/README.md, cpu9)
PREFILL_MAX_CONTEXT = 2048
_MAX_SEGMENTS = 4  # layer.c's MAX_SEGMENTS
_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Segment(ctypes.Structure):
    _fields_ = [("kind", _i64), ("qs", _p), ("d", _p), ("m", _p), ("n", _i64)]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("seg", _Segment * _MAX_SEGMENTS),
        ("nseg", _i64),
        ("k", _i64),
        ("n", _i64),
        ("bias", _p),
        ("int_rows", _i64),
        ("int8_rows", _i64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("kv_cache", _p)]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64), ("hidden", _i64), ("intermediate", _i64), ("heads", _i64), ("kv_heads", _i64),
        ("head_dim", _i64), ("eps", _f32), ("scale", _f32), ("window", _i64), ("num_blocks", _i64),
        ("block_size", _i64), ("width", _i64), ("cos", _p), ("sin", _p), ("final_norm", _p),
        ("embed_kind", _i64), ("embed_qs", _p), ("embed_d", _p), ("embed_m", _p), ("kv_kind", _i64),
        ("prefill_attn", _i64),
    ]  # fmt: skip


def enabled() -> bool:
    return envs.get(ENV_SWITCH)


def prefill_enabled() -> bool:
    """Read when a plan is built; only ``1`` (the default) and ``0`` are accepted."""
    return envs.get(PREFILL_SWITCH)


def prefill_attention_mode() -> int:
    """How a native prefill call attends (``DEEPINFER_PREFILL_ATTENTION``, read when a plan is
    built): 2 (the default) ``prefill_attention.c`` with the call's own keys and values in
    float32 as computed, earlier positions from the cache; 1 the same kernel reading every key
    and value from the cache (rounded to half there); 0 the decode kernel, a query at a time."""
    return int(envs.get(PREFILL_ATTENTION_SWITCH))


def _float_vector(t: torch.Tensor | None, n: int) -> int | None:
    """The pointer of a contiguous float32 [n] tensor, or None when it is not one."""
    if t is None or t.dtype != torch.float32 or not t.is_contiguous() or t.shape != (n,) or t.device.type != "cpu":
        return None
    return t.data_ptr()


def _packed_ok(w: QuantWeight) -> bool:
    """The layout the kernels read: contiguous codes, float32 scales (and offsets for 4 bits)."""
    parts = (w.d,) if w.kind == "q8" else (w.d, w.m)
    return w.qs.is_contiguous() and all(t is not None and t.dtype == torch.float32 and t.is_contiguous() for t in parts)


def _linear(module: nn.Module, k: int, n: int) -> _Linear | None:
    if type(module) is not LowBitLinear or not module.segments or len(module.segments) > _MAX_SEGMENTS:
        return None
    if module.in_features != k or module.out_features != n or sum(w.qs.shape[0] for w in module.segments) != n:
        return None
    lin = _Linear(nseg=len(module.segments), k=k, n=n, int_rows=module.int_rows, int8_rows=module.int8_rows)
    for i, w in enumerate(module.segments):
        if w.kind not in KIND_CODE or not _packed_ok(w):
            return None
        lin.seg[i] = _Segment(
            KIND_CODE[w.kind], w.qs.data_ptr(), w.d.data_ptr(), None if w.m is None else w.m.data_ptr(), w.qs.shape[0]
        )
    if module.bias is not None:
        if (bias := _float_vector(module.bias.data, n)) is None:
            return None
        lin.bias = bias
    return lin


class LlamaDecodePlan:
    """The model described for ``llama_decode_step``; built once, after the weights are in."""

    def __init__(
        self, lib: ctypes.CDLL, md: _Model, layers: ctypes.Array, keep: list[torch.Tensor], max_positions: int
    ) -> None:
        self._lib, self._md, self._layers, self._keep = lib, md, layers, keep
        self._max_positions = max_positions
        self._caches: tuple[int, ...] = ()
        self._scratch = torch.empty(0)
        self._per_row = lib.llama_decode_scratch_per_row(ctypes.byref(md))
        # None, or float64 [3] that each step adds its CPU ms to: GEMMs, attention, the rest
        # (benchmarks/cpu/cpu_step_profile.py sets it; a few clock reads per layer when set)
        self.phase_ms: torch.Tensor | None = None
        # the step's thread count by measured wall time (threads.py); None: torch's count
        self.threads: ThreadChooser | None = ThreadChooser() if adaptive_enabled() else None
        self.prefill = prefill_enabled()
        md.prefill_attn = prefill_attention_mode()

    @property
    def prefill_attention(self) -> int:
        """:func:`prefill_attention_mode`'s value for this plan (settable, for side-by-side runs)."""
        return int(self._md.prefill_attn)

    @prefill_attention.setter
    def prefill_attention(self, mode: int) -> None:
        if str(mode) not in PREFILL_ATTENTION_MODES:
            raise ValueError(f"prefill_attention={mode!r}: allowed values are 0, 1 and 2")
        self._md.prefill_attn = int(mode)

    def applies(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Every request feeds one token, positions inside the rotary table, no replay."""
        return (meta.max_query_len == 1 and input_ids.shape[0] == meta.num_requests and not meta.replay
                and not meta.batch_invariant and meta.max_seq_len <= self._max_positions
                and input_ids.device.type == "cpu")  # fmt: skip

    def applies_prefill(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A multi-token step (prefill, chunked prefill, prefill mixed with decode rows) whose
        contexts stay within :data:`PREFILL_MAX_CONTEXT` and the rotary table."""
        return (self.prefill and meta.max_query_len > 1 and not meta.replay and not meta.batch_invariant
                and meta.max_seq_len <= min(self._max_positions, PREFILL_MAX_CONTEXT)
                and input_ids.device.type == "cpu")  # fmt: skip

    def _bind(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point the layers at the engine's caches (once; again only if they were reallocated)."""
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs == self._caches:
            return True
        md = self._md
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[1] != md.kv_heads or first.shape[4] < md.head_dim:
            return False
        md.num_blocks, md.block_size, md.width = first.shape[2], first.shape[3], first.shape[4]
        want = (2, md.kv_heads, md.num_blocks, md.block_size, md.width)
        if len(kv_caches) != md.num_layers or any(
            tuple(c.shape) != want or c.dtype != first.dtype or c.dtype not in CACHE_DTYPES or not c.is_contiguous()
            for c in kv_caches
        ):
            return False
        md.kv_kind = kv_kind(first.dtype)
        for layer, ptr in zip(self._layers, ptrs):
            layer.kv_cache = ptr
        self._caches = ptrs
        return True

    def run(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The final-normed hidden states [R, D], or None when this step must take the torch path."""
        return self._run(input_ids, kv_caches, meta, None)

    def run_hidden(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`run` and the last layer's output before the final norm ([T, D] each), for a
        speculative drafter: the native plan leaves the residual sum in the scratch's first
        rows (layer.c: ``add_rmsnorm(h, ...)``, h = scratch)."""
        pre = torch.empty(input_ids.shape[0], self._md.hidden)
        out = self._run(input_ids, kv_caches, meta, pre)
        return None if out is None else (out, pre)

    def _run(self, input_ids, kv_caches, meta, pre: torch.Tensor | None) -> torch.Tensor | None:
        decode = self.applies(input_ids, meta)
        if not (decode or self.applies_prefill(input_ids, meta)) or not self._bind(kv_caches):
            return None
        T = input_ids.shape[0]
        ids = input_ids if input_ids.dtype == torch.int64 else input_ids.long()
        positions = meta.positions if meta.positions.dtype == torch.int64 else meta.positions.long()
        slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.long()
        tables = meta.block_tables if meta.block_tables.dtype == torch.int32 else meta.block_tables.int()
        if not decode:  # one row per token, each with its request's block table
            qlens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
            tables = tables.index_select(0, torch.repeat_interleave(torch.arange(qlens.shape[0]), qlens, output_size=T))
        ids, positions, slots, tables = (
            ids.contiguous(),
            positions.contiguous(),
            slots.contiguous(),
            tables.contiguous(),
        )
        out = torch.empty(T, self._md.hidden)
        rows = T if decode else min(T, PREFILL_CHUNK)
        if self._scratch.numel() < rows * self._per_row:  # grows to the largest batch seen, then stays
            self._scratch = torch.empty(rows * self._per_row)
        for a in range(0, T, rows):
            self._call(
                ids[a : a + rows],
                positions[a : a + rows],
                slots[a : a + rows],
                tables[a : a + rows],
                out[a : a + rows],
                decode,
            )
            if pre is not None:
                n = min(rows, T - a)
                pre[a : a + n] = self._scratch[: n * self._md.hidden].view(n, self._md.hidden)
        return out

    def _call(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        out: torch.Tensor,
        decode: bool,
    ) -> None:
        R, most = ids.shape[0], torch.get_num_threads()
        if self.threads is None:
            threads = most
        elif decode:
            threads = self.threads.pick(most, R)
        else:
            # prefill takes the count the decode steps chose, never a probe (a 512-row probe on the slower
            # count costs ~0.7 s)
            threads = min(self.threads.current or most, most)
        start = time.perf_counter()
        self._lib.llama_decode_step(
            ctypes.byref(self._md), self._layers, ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.shape[1], R, self._scratch.data_ptr(), out.data_ptr(), threads,
            None if self.phase_ms is None else self.phase_ms.data_ptr(),
        )  # fmt: skip
        if self.threads is not None and decode:
            self.threads.record(threads, R, (time.perf_counter() - start) * 1e3)


def plan_for(model: nn.Module) -> LlamaDecodePlan | None:
    """A plan for a :class:`~deepinfer_core.models.llama.model.LlamaForCausalLM` whose every layer is
    the plain Llama layer on packed weights with the paged-decode backend; None otherwise (or
    when the switch is off or the kernels are not built)."""
    lib = load().lib
    if not enabled() or lib is None:
        return None
    layers = list(model.model.layers)
    if not layers:
        return None
    spec0 = layers[0].self_attn.spec
    D, I = model.config["hidden_size"], model.config["intermediate_size"]
    H, Hkv, hd = spec0.num_heads, spec0.num_kv_heads, spec0.head_dim
    eps = layers[0].input_layernorm.eps
    descs = (_Layer * len(layers))()
    for i, layer in enumerate(layers):
        attn, mlp, spec = layer.self_attn, layer.mlp, layer.self_attn.spec
        if (type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention or type(mlp) is not GatedMLP
                or type(attn.backend) is not PagedDecodeAttention or spec.kv_shared or spec.v_head_dim != hd
                or (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale, spec.window) != (H, Hkv, hd,
                                                                                                   spec0.scale,
                                                                                                   spec0.window)
                or mlp.fused_act is not None or hd % 2):  # fmt: skip
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.fused is not None or n.eps != eps for n in norms):
            return None
        ptrs = [_float_vector(n.weight.data, D) for n in norms]
        lins = [_linear(attn.qkv_proj, D, (H + 2 * Hkv) * hd), _linear(attn.o_proj, H * hd, D),
                _linear(mlp.gate_up_proj, D, 2 * I), _linear(mlp.down_proj, I, D)]  # fmt: skip
        if None in ptrs or None in lins:
            names = ["input_layernorm", "post_attention_layernorm", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
            modules = [*norms, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            bad = ", ".join(
                f"{n} ({m.extra_repr() if isinstance(m, LowBitLinear) else type(m).__name__ + ' ' + m.extra_repr()})"
                for n, m, v in zip(names, modules, ptrs + lins)
                if v is None
            )
            log.warning(
                "decode steps take the per-op torch path, not the one-call native plan: layer %d's %s cannot be run "
                "by it "
                "(a dense tensor in a block-quantized file, e.g. an input width that is not a multiple of 32)",
                i,
                bad,
            )
            return None
        descs[i] = _Layer(ptrs[0], ptrs[1], *lins, None)
    final = model.model.norm
    if (
        type(final) is not RMSNorm
        or final.fused is not None
        or final.eps != eps
        or (final_ptr := _float_vector(final.weight.data, D)) is None
    ):
        return None
    cos, sin = model.rotary.cos, model.rotary.sin
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.shape[1] != hd for t in (cos, sin)):
        return None
    md = _Model(num_layers=len(layers), hidden=D, intermediate=I, heads=H, kv_heads=Hkv, head_dim=hd, eps=eps,
                scale=spec0.scale, window=spec0.window or 0, cos=cos.data_ptr(), sin=sin.data_ptr(),
                final_norm=final_ptr)  # fmt: skip
    embed = model.model.embed_tokens
    if type(embed) is LowBitEmbedding and isinstance(embed.weight_q, QuantWeight) and embed.weight_q.kind in KIND_CODE:
        w = embed.weight_q
        if w.shape[1] != D or not _packed_ok(w):
            return None
        md.embed_kind, md.embed_qs, md.embed_d = KIND_CODE[w.kind], w.qs.data_ptr(), w.d.data_ptr()
        md.embed_m = None if w.m is None else w.m.data_ptr()
    elif type(embed) is nn.Embedding and embed.weight.dtype == torch.float32 and embed.weight.is_contiguous():
        md.embed_kind, md.embed_qs = 0, embed.weight.data_ptr()
    else:
        return None
    return LlamaDecodePlan(lib, md, descs, [cos, sin], cos.shape[0])
