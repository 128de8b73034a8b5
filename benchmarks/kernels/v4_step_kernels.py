"""Kernels of one 1-request DeepSeek-V4 decode step, by part of the model (CPU, no GPU needed).

Why: V4-mini's 1-request step took 41 ms on the H200 eagerly (benchmarks/README.md) while its
attention kernels were 3.5-4.7x faster than the reference: the step is launch-bound. This counts
what a GPU would launch - every non-view torch op, plus one per Triton kernel call - for

* ``eager``: the general forward (what every V4 step ran before CUDA graphs);
* ``static torch``: ``forward_decode`` (the fixed-shape step the graphs capture), torch ops only;
* ``static + kernels``: the same with cuda_sm100's V4 kernels (``hc_pre``, ``hc_mix``, ``hc_merge``,
  ``compress_decode``, ``v4_rms_norm``, ``v4_unweighted_rms_norm``, ``v4_rope``; run here in
  Triton's interpreter, each call counted as its launches: one, ``hc_pre`` two).

The model is V4-mini's layer layout (sliding, then CSA / HCA alternating, 20 Sinkhorn
iterations, 4 streams) at tiny widths: the counts do not depend on the widths. Attention and MoE
run the builtin torch backends here (on the GPU they are 2 and ~6 Triton launches a layer), so
those rows overstate the GPU; the hyper-connection and compressor rows are what the GPU runs.

    TRITON_INTERPRET=1 python benchmarks/kernels/v4_step_kernels.py
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.models.deepseek_v4 import model as m4  # noqa: E402
from deepinfer_core.testing.v4_tiny import save_tiny_v4, tiny_v4_config  # noqa: E402

LAYOUT = (
    ["sliding_attention"] + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3 + ["sliding_attention"]
)


class Count(TorchDispatchMode):
    """Counts non-view ops (a view aliases its input without writing: no kernel) by part."""

    def __init__(self) -> None:
        super().__init__()
        self.by_part: collections.Counter = collections.Counter()
        self.part = "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rets = func._schema.returns
        info = rets[0].alias_info if rets else None
        if info is None or info.is_write:
            self.by_part[self.part] += 1
        return func(*args, **(kwargs or {}))


def tagged(fn, part: str, counter_of, launch: int = 0):
    """``fn`` with its ops counted under ``part`` (a Triton kernel: ``launch`` launches a call,
    its ops not counted)."""

    def inner(*args, **kwargs):
        counter = counter_of()
        if counter is None:
            return fn(*args, **kwargs)
        if launch:
            counter.by_part[part] += launch
            with _disable_current_modes():
                return fn(*args, **kwargs)
        outer, counter.part = counter.part, part
        try:
            return fn(*args, **kwargs)
        finally:
            counter.part = outer

    return inner


class KernelCompressors:
    """A V4 backend whose decode-step compressors are the plugin's kernel."""

    def __init__(self, inner, compress) -> None:
        self.inner, self.name, self.compress_decode = inner, inner.name, compress

    def forward_v4(self, *args, **kwargs):
        return self.inner.forward_v4(*args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=300, help="tokens before the counted step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    state = {"counter": None}
    counter_of = lambda: state["counter"]  # noqa: E731
    m4.update_entries = tagged(m4.update_entries, "compressors", counter_of)
    m4.decode_update_entries = tagged(m4.decode_update_entries, "compressors", counter_of)
    m4.decode_select = tagged(m4.decode_select, "indexer", counter_of)
    m4.Indexer.select = tagged(m4.Indexer.select, "indexer", counter_of)
    m4.HyperConnection.forward = tagged(m4.HyperConnection.forward, "hyper-connections", counter_of)
    m4.HyperConnection.merge = tagged(m4.HyperConnection.merge, "hyper-connections", counter_of)
    m4.V4MoE.forward = tagged(m4.V4MoE.forward, "MoE (builtin)", counter_of)
    m4.V4RMSNorm.forward = tagged(m4.V4RMSNorm.forward, "norms", counter_of)
    m4.unweighted_rms_norm = tagged(m4.unweighted_rms_norm, "norms", counter_of)
    m4.V4Rope.apply = staticmethod(tagged(m4.V4Rope.apply, "rope", counter_of))
    m4.V4Rope.cos_sin = tagged(m4.V4Rope.cos_sin, "rope", counter_of)

    cfg = tiny_v4_config(
        num_hidden_layers=len(LAYOUT),
        layer_types=LAYOUT,
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        max_position_embeddings=1024,
    )
    with tempfile.TemporaryDirectory(prefix="v4kernels") as path:  # the engine keeps the weights in memory
        save_tiny_v4(path, 1, 2, cfg)
        llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, max_num_seqs=4)
    model, engine = llm.engine.model, llm.engine
    rows: dict[str, collections.Counter] = {}

    class Probe:  # counts the first decode step at the context length, then lets the engine run it
        def run(self, input_ids, meta):
            if rows or int(meta.positions[0]) < args.context:
                return None
            for name, step in (
                ("eager", model.forward),
                ("static torch", model.forward_decode),
                ("static + kernels", None),
            ):
                caches = [type(c)(c.entries.clone(), c.window.clone(), c.tail.clone()) for c in engine.runner.kv_caches]
                undo = []
                if step is None:
                    undo = install_kernels(model, counter_of)
                    step = model.forward_decode
                state["counter"] = Count()
                with state["counter"]:
                    step(input_ids, meta.positions, caches, meta)
                rows[name] = state["counter"].by_part
                state["counter"] = None
                for fn in undo:
                    fn()
            return None

    engine.runner.graphs = Probe()
    llm.generate([list(range(2, 2 + args.context))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    parts = sorted({p for c in rows.values() for p in c}, key=lambda p: -rows["eager"][p])
    print(
        f"V4-mini layout ({len(LAYOUT)} layers: sliding, 3 CSA, 3 HCA, sliding; 20 Sinkhorn iterations), 1 request at "
        f"position {args.context}"
    )
    print("| part | " + " | ".join(rows) + " |\n|---|" + "---:|" * len(rows))
    for p in parts + ["total"]:
        cells = [sum(c.values()) if p == "total" else c[p] for c in rows.values()]
        print(f"| {p} | " + " | ".join(map(str, cells)) + " |")


def install_kernels(model, counter_of) -> list:
    """The plugin's hc_mix and compress_decode on every layer; returns the undo callables."""
    from deepinfer_cuda_sm100.attention import TritonV4Attention
    from deepinfer_cuda_sm100.kernels.hyper_connection import hc_merge, hc_mix, hc_pre
    from deepinfer_cuda_sm100.kernels.v4_elementwise import v4_rms_norm, v4_rope, v4_unweighted_rms_norm

    pre = tagged(hc_pre, "hyper-connections", counter_of, launch=2)  # the split-K product, then the mix
    mix = tagged(hc_mix, "hyper-connections", counter_of, launch=1)
    merge = tagged(hc_merge, "hyper-connections", counter_of, launch=1)
    compress = tagged(TritonV4Attention().compress_decode, "compressors", counter_of, launch=1)
    norm = tagged(v4_rms_norm, "norms", counter_of, launch=1)
    rope = tagged(v4_rope, "rope", counter_of, launch=1)
    qnorm = tagged(v4_unweighted_rms_norm, "norms", counter_of, launch=1)
    undo = []
    for module in model.modules():
        if isinstance(module, m4.HyperConnection):
            module.fused_mix, module.fused_merge, module.fused_pre = mix, merge, pre
            undo.append(lambda m=module: [setattr(m, a, None) for a in ("fused_mix", "fused_merge", "fused_pre")])
        elif isinstance(module, m4.V4RMSNorm):
            module.fused = norm
            undo.append(lambda m=module: setattr(m, "fused", None))
        elif isinstance(module, m4.V4Attention):
            module.rope_kernel, module.norm_kernel = rope, qnorm
            undo.append(lambda m=module: (setattr(m, "rope_kernel", None), setattr(m, "norm_kernel", None)))
    for layer in model.model.layers:
        attn = layer.self_attn
        inner = attn.backend
        attn.backend = KernelCompressors(inner, compress)
        undo.append(lambda a=attn, b=inner: setattr(a, "backend", b))
    return undo


if __name__ == "__main__":
    main()
