"""Independent check of the cuda_sm100 plugin on models and batch shapes nobody tuned for.

Random-weight checkpoints of the three architectures the engine serves (LlamaForCausalLM,
DeepseekV3ForCausalLM, DeepseekV4ForCausalLM) with configurations no test or benchmark uses
(head widths 80 / 96 / 256, one KV head, query heads not a power of two, vocabularies not a
multiple of 64, tied / untied embeddings, llama3 rope scaling, a short max position; V3 without
a query LoRA, 8 / 72 / 160 experts, top-1 / top-8, unnormalised weights, expert widths that are
not a multiple of 128, hidden 1,536 / 2,560, FP8 block-scaled; V4 with other windows, compress
ratios, hyper-connection counts, MTP on / off) run through ``LLM(device="cuda")`` with the
plugin's defaults (Triton attention and MoE, fused ops, CUDA graphs, overlap) and through the
builtin reference path on the same device (builtin attention and MoE, no fused ops, eager), in
float32, on batches of 2-300 requests with mixed prompt lengths (1, 127-129, 1,000, 5,000
tokens with chunked prefill), greedy and seeded top-p requests in one batch, stop token ids,
``max_tokens=1``, requests aborted mid-batch and prefix-cache hits.

A cell passes when every greedy request's tokens equal the reference's, or where they part,
the reference's own float32 logits (teacher-forced, ``prompt_logits``) call the first
difference a near-tie (< 1e-4); seeded requests must match too (the noise depends only on seed
and position). A crash, a hang (``--cell-timeout``), the plugin's kernels not in place (a silent
fall-back), or non-finite logits fail. Each config also runs a bf16 engine of the plugin: its
prompt logits must be finite; the table reports their largest distance to the float32
reference's, over the logits' standard deviation.

    python benchmarks/gpu/gpu_shapes_check.py                  # GPU: every config, the default shapes
    python benchmarks/gpu/gpu_shapes_check.py --full           # every config x every batch shape
    python benchmarks/gpu/gpu_shapes_check.py --device cpu --tiny --configs llama-hd80-mqa  # plumbing only

On the CPU both engines are the builtin path (the plugin answers for CUDA only), so ``--device
cpu`` checks the script, not the plugin. Exit status 1 when a cell fails.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REFERENCE = dict(attention_backend="builtin", moe_backend="builtin", fused_ops=False, enforce_eager=True)

# name -> (architecture, config overrides); sizes are the GPU's, --tiny shrinks them for the CPU
CONFIGS = {
    "llama-hd80-mqa-tied-llama3": (
        "llama",
        dict(
            vocab_size=1003,
            hidden_size=560,
            intermediate_size=1000,
            num_hidden_layers=2,
            num_attention_heads=7,
            num_key_value_heads=1,
            head_dim=80,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        ),
    ),
    "llama-hd96-h6kv3-untied": (
        "llama",
        dict(
            vocab_size=2051,
            hidden_size=576,
            intermediate_size=1100,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=96,
            tie_word_embeddings=False,
            max_position_embeddings=8192,
            attention_bias=True,
        ),
    ),
    "llama-hd256-h2kv2-maxpos1152": (
        "llama",
        dict(
            vocab_size=515,
            hidden_size=512,
            intermediate_size=700,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=256,
            tie_word_embeddings=False,
            max_position_embeddings=1152,
        ),
    ),
    "llama-hd64-h10kv5-hidden640": (
        "llama",
        dict(
            vocab_size=3001,
            hidden_size=640,
            intermediate_size=1728,
            num_hidden_layers=2,
            num_attention_heads=10,
            num_key_value_heads=5,
            head_dim=64,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
    ),
    "llama-hd48-h9kv3-yarn": (
        "llama",
        dict(  # added after the 21:54 run (Llama yarn rope loads since 2264fa8)
            vocab_size=4099,
            hidden_size=432,
            intermediate_size=800,
            num_hidden_layers=2,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=48,
            tie_word_embeddings=False,
            max_position_embeddings=8192,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        ),
    ),
    "llama-hd112-mlpbias-h5kv1": (
        "llama",
        dict(  # added after the 21:54 run (mlp_bias loads since 9aba604)
            vocab_size=1531,
            hidden_size=560,
            intermediate_size=900,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=112,
            mlp_bias=True,
            attention_bias=True,
            tie_word_embeddings=False,
            max_position_embeddings=8192,
        ),
    ),
    "v3-noshared-e12-top2": (
        "v3",
        dict(  # added after the 21:54 run (n_shared_experts 0 loads since 2189b18)
            vocab_size=700,
            hidden_size=384,
            intermediate_size=640,
            moe_intermediate_size=136,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_attention_heads=6,
            num_key_value_heads=6,
            q_lora_rank=192,
            kv_lora_rank=128,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_routed_experts=12,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=0,
            routed_scaling_factor=1.0,
        ),
    ),
    "v3-v2lite-nolora-e72-top6": (
        "v3",
        dict(
            vocab_size=1100,
            hidden_size=512,
            intermediate_size=1000,
            moe_intermediate_size=176,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=None,
            kv_lora_rank=256,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_routed_experts=72,
            num_experts_per_tok=6,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            routed_scaling_factor=1.0,
        ),
    ),
    "v3-h1536-e160-top8-g8of3": (
        "v3",
        dict(
            vocab_size=1537,
            hidden_size=1536,
            intermediate_size=2048,
            moe_intermediate_size=96,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_attention_heads=12,
            num_key_value_heads=12,
            q_lora_rank=384,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=160,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=3,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        ),
    ),
    "v3-h2560-e8-top1-unnorm-w200-dense2": (
        "v3",
        dict(
            vocab_size=999,
            hidden_size=2560,
            intermediate_size=1200,
            moe_intermediate_size=200,
            num_hidden_layers=3,
            first_k_dense_replace=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=256,
            kv_lora_rank=128,
            qk_rope_head_dim=16,
            qk_nope_head_dim=48,
            v_head_dim=40,
            n_routed_experts=8,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            norm_topk_prob=False,
            routed_scaling_factor=2.5,
        ),
    ),
    "v3-fp8-h1536-e16-top4": (
        "v3fp8",
        dict(
            vocab_size=777,
            hidden_size=1536,
            intermediate_size=1408,
            moe_intermediate_size=256,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
        ),
    ),
    "v4-win32-hc2-nomtp-bf16": (
        "v4",
        dict(
            sliding_window=32,
            hc_mult=2,
            compress_ratios=[4, 0, 128, 4],
            num_nextn_predict_layers=0,
            compress_rate_hca=16,
            index_topk=8,
            num_hidden_layers=4,
            num_attention_heads=8,
            head_dim=64,
            n_routed_experts=12,
            num_experts_per_tok=3,
            weights="bf16",
        ),
    ),
    "v4-win8-hc3-mtp-fp8": (
        "v4",
        dict(
            sliding_window=8,
            hc_mult=3,
            compress_ratios=[0, 4, 128, 0, 4],
            num_nextn_predict_layers=1,
            compress_rate_hca=4,
            index_topk=3,
            num_hidden_layers=4,
            num_attention_heads=6,
            head_dim=64,
            num_hash_layers=1,
            weights="fp8",
        ),
    ),
}

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    v_head_dim=16,
    qk_rope_head_dim=8,
)

# name -> (prompt lengths, cycled; number of requests)
LENS = (1, 2, 17, 63, 127, 128, 129, 255, 300, 1000)
SHAPES = {
    "b2-long": ((1, 5000), 2),
    "b3-blocks": ((127, 128, 129), 3),
    "b7": (LENS[::-1][:7], 7),
    "b31": (LENS, 31),
    "b33": (LENS, 33),
    "b100": (LENS, 100),
    "b129": (LENS, 129),
    "b255": (LENS, 255),
    "b257": (LENS, 257),
    "b300": (LENS, 300),
    "abort": (LENS, 40),
    "prefix-again": (LENS, 33),
    "preempt": ((300, 450, 129, 600), 24),
    "invariant": (
        LENS,
        33,
        # bf16, batch_invariant=True: requests 0, 7, 32 alone = in the batch  # own engines with 16 KV blocks: requests
        # preempted and recomputed
    ),
}
DEFAULT_SHAPES = ["b2-long", "b3-blocks", "b7", "b33", "abort", "prefix-again"]
ROTATE = ["b31", "b100", "b129", "b255", "b257", "b300"]  # each config also takes two of these, in turn


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout("cell timed out (hang?)")


def llama_checkpoint(path, cfg):
    import transformers

    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**cfg, initializer_range=0.15, bos_token_id=0, eos_token_id=1)
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


def v3_checkpoint(path, cfg):
    from deepinfer_core.testing.v3_checkpoint import tiny_deepseek_v3

    # routing that matters: sharp gates, a correction bias
    model = tiny_deepseek_v3(path, seed=5, router_gain=6.0, **cfg, max_position_embeddings=8192, initializer_range=0.1)
    return model, model.config


def v3_fp8_checkpoint(path, cfg):
    """The V3 checkpoint rewritten in DeepSeek's FP8 block format (e4m3 + a float32 scale per
    128 x 128 tile; experts per expert, the released layout)."""
    from deepinfer_core.testing.v3_checkpoint import rewrite_as_fp8_blocks

    v3_checkpoint(path, cfg)
    rewrite_as_fp8_blocks(path)
    return None, None


def v4_checkpoint(path, cfg):
    from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint

    cfg = dict(cfg)
    weights = cfg.pop("weights")
    config = dict(TINY_V4_CONFIG) | cfg
    n = config["num_hidden_layers"] + config["num_nextn_predict_layers"]
    config["compress_ratios"] = (list(config["compress_ratios"]) + [0] * n)[:n]
    write_tiny_v4_checkpoint(path, weights=weights, experts="fp4" if weights == "fp8" else "bf16", config=config)
    return None


def build(path: Path, name: str, tiny: bool):
    """(config.json as written, transformers' float32 model or None)."""
    arch, cfg = CONFIGS[name]
    cfg = dict(cfg)
    if tiny and arch != "v4":
        for k, v in TINY.items():
            if k in cfg:
                cfg[k] = v
        if arch == "llama":
            cfg["hidden_size"] = cfg["num_attention_heads"] * (
                cfg["head_dim"] // 4 * 4 if cfg["head_dim"] < 100 else 16
            )
        for k in ("n_routed_experts",):
            if k in cfg and cfg[k] > 16:
                cfg[k], cfg["n_group"], cfg["topk_group"] = 16, 1, 1
                cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], 4)
        if cfg.get("q_lora_rank"):
            cfg["q_lora_rank"] = 32
    hf = {"llama": llama_checkpoint, "v3": v3_checkpoint, "v3fp8": v3_fp8_checkpoint, "v4": v4_checkpoint}[arch](
        path, cfg
    )
    hf = hf[0] if isinstance(hf, tuple) else hf
    return json.loads((path / "config.json").read_text()), hf


def prompts_for(shape: str, config: dict, seed: int, limit: int) -> list[list[int]]:
    lens, n = SHAPES[shape]
    vocab = config["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(2, vocab, (300,), generator=g).tolist()
    out = []
    for i in range(n):
        p = torch.randint(2, vocab, (min(lens[i % len(lens)], limit),), generator=g).tolist()
        out.append((shared + p[:40])[:limit] if i % 5 == 0 and n > 5 else p)
    return out


def params_for(n: int, vocab: int, mixed: bool = True):
    from deepinfer_core import SamplingParams

    out = []
    for i in range(n):
        mt = 1 + (i * 7) % 24
        if mixed and i % 4 == 3:  # seeded top-p beside the greedy requests
            out.append(SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, max_tokens=mt, ignore_eos=True))
        elif mixed and i % 6 == 5:  # a stop token id (a random model: stop strings need a tokenizer)
            out.append(
                SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True, stop_token_ids=[2 + i % (vocab - 2)])
            )
        else:
            out.append(SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True))
    return out


def generate(llm, prompts, params):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def generate_with_aborts(llm, prompts, params):
    """Add every request, step 3 times, abort every 7th, run the rest to the end."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            for i in range(0, len(ids), 7):
                engine.abort_request(ids[i])
    return [None if i % 7 == 0 else outputs[r] for i, r in enumerate(ids)]


def compare(got, want, prompts, params, reference) -> tuple[bool, str]:
    """(passed, note): identical, or first greedy difference a near-tie in the reference's logits."""
    diff = ties = 0
    for i, (a, b, p, sp) in enumerate(zip(got, want, prompts, params)):
        if a is None and b is None or a == b:
            continue
        diff += 1
        if sp.temperature != 0:
            return False, f"seeded request {i} differs: {a[:6]} vs {b[:6]}"
        j = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
        if j is None:
            return False, f"request {i}: {len(a)} tokens vs the reference's {len(b)}"
        logits = reference.engine.prompt_logits(p + a[:j])[-1].double()  # the shared prefix: what chose token j
        gap = abs(float(logits[a[j]] - logits[b[j]]))
        if not torch.isfinite(logits).all():
            return False, f"request {i}: non-finite reference logits"
        if gap >= 1e-4:
            return False, f"request {i} (prompt {len(p)}) token {j}: {a[j]} vs {b[j]}, gap {gap:.2e}"
        ties += 1
    return True, f"{ties} near-tie" if ties else "identical"


def preempt_cell(path, kw, config, limit) -> str:
    """Both engines with 16 blocks (the tiny run's 40) for 24 requests of 129-600 tokens + up to
    24 new: the scheduler preempts and recomputes; tokens must still agree."""
    from deepinfer_core import LLM

    small = dict(kw, kv_cache_blocks=40 if kw.get("block_size") == 16 else 16, max_num_seqs=24)
    prompts = prompts_for("preempt", config, seed=5, limit=min(limit, 600))
    params = params_for(len(prompts), config["vocab_size"])
    ours = LLM(str(path), **small)
    got = generate(ours, prompts, params)
    n = ours.engine.scheduler.num_preemptions
    del ours
    ref = LLM(str(path), **small, **REFERENCE)
    want = generate(ref, prompts, params)
    ok, note = compare(got, want, prompts, params, ref)
    if n == 0:
        return f"FAIL (no preemption happened: the cell checked nothing, {note})"
    return ("pass" if ok else "FAIL") + f" ({note}, {n} preemptions)"


def invariant_cell(path, kw, config, limit) -> str:
    from deepinfer_core import LLM, SamplingParams

    llm = LLM(
        str(path), **dict(kw, dtype="bfloat16", max_num_seqs=33), batch_invariant=True, enable_prefix_caching=False
    )
    prompts = prompts_for("invariant", config, seed=6, limit=min(limit, 1000))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = generate(llm, prompts, params)
    for i in (0, 7, 32):
        if generate(llm, [prompts[i]], params)[0] != batch[i]:
            return f"FAIL (request {i} alone differs from its place in the batch of 33)"
    return "pass (3 requests alone = in the batch)"


def plugin_in_place(llm, arch: str, device: str, interpret: bool = False) -> str | None:
    """None when the plugin's kernels run this model, else what fell back."""
    if device != "cuda" and not interpret:
        return None
    mods = list(llm.engine.model.modules())
    backends = {type(getattr(m, "backend", None)).__name__ for m in mods}
    dispatchers = {type(getattr(m, "dispatcher", None)).__name__ for m in mods}
    want = "TritonV4Attention" if arch == "v4" else "TritonAttention"
    if want not in backends:
        return f"attention {sorted(backends - {'NoneType'})}"
    if arch != "llama" and "TritonMoEDispatcher" not in dispatchers:
        return f"moe {sorted(dispatchers - {'NoneType'})}"
    if device == "cuda" and getattr(llm.engine.runner, "graphs", None) is None:
        return "no decode graphs"
    return None


def plugin_on_the_cpu() -> None:
    """The host answers with the plugin's Triton attention, MoE dispatcher and fused ops (its
    hooks answer for CUDA platforms only) unless a backend is named, as the reference names
    "builtin"; the kernels then run in Triton's interpreter (TRITON_INTERPRET=1, set before
    Triton is imported)."""
    from dataclasses import replace

    from deepinfer_core.plugin_host import PluginHost
    from deepinfer_cuda_sm100.attention import TritonAttention, TritonV4Attention
    from deepinfer_cuda_sm100.kernels import fused_elementwise
    from deepinfer_cuda_sm100.kernels.fused_elementwise import FUSED_OPS
    from deepinfer_cuda_sm100.kernels.logits import lm_logits
    from deepinfer_cuda_sm100.moe import TritonMoEDispatcher

    attention, moe, fused = PluginHost.attention_backend, PluginHost.moe_dispatcher, PluginHost.fused_ops

    def pick_attention(self, layer, platform, name=None):
        if name is not None:
            return attention(self, layer, platform, name)
        return TritonV4Attention() if layer.state_kv else TritonAttention()

    PluginHost.attention_backend = pick_attention
    PluginHost.moe_dispatcher = lambda self, m, platform, parallel=None, name=None: (
        TritonMoEDispatcher() if name is None else moe(self, m, platform, parallel, name)
    )
    PluginHost.fused_ops = lambda self, platform: replace(FUSED_OPS, logits=lm_logits)
    fused_elementwise.ROPE_CAT_TILE_TOKENS = 0  # rope_cat's per-token form: the interpreter's cost is per program
    del fused


def check_config(name: str, shapes: list[str], args) -> dict:
    from deepinfer_core import LLM

    arch = CONFIGS[name][0]
    row: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        t0 = time.time()
        try:
            config, hf = build(path, name, args.tiny)
        except Exception as exc:  # noqa: BLE001
            return {"build": f"CRASH {type(exc).__name__}: {exc}"}
        limit = min(config.get("max_position_embeddings", 8192) - 30, 5000 if not args.tiny else 300, args.max_prompt)
        maxn = max(SHAPES[s][1] for s in shapes)
        kw = dict(
            device=args.device,
            dtype="float32",
            max_num_seqs=maxn,
            max_num_batched_tokens=1024,
            kv_cache_blocks=args.blocks if not args.tiny else None,
            block_size=128 if not args.tiny else 16,
        )
        if args.tiny:
            kw["kv_cache_blocks"] = 400
        try:
            ours = LLM(str(path), **kw)
            ref = LLM(str(path), **kw, **REFERENCE)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            return {"build": f"CRASH {type(exc).__name__}: {str(exc)[:200]}"}
        fallback = plugin_in_place(ours, arch, args.device, args.interpret)
        row["plugin"] = ("FAIL " + fallback) if fallback else "ok"
        print(f"[{name}] engines ready in {time.time() - t0:.1f}s; plugin: {row['plugin']}", flush=True)
        for k, shape in enumerate(shapes):
            t1 = time.time()
            signal.alarm(args.cell_timeout)
            try:
                if shape in ("preempt", "invariant"):
                    row[shape] = (preempt_cell if shape == "preempt" else invariant_cell)(path, kw, config, limit)
                    print(f"[{name}] {shape}: {row[shape]} ({time.time() - t1:.1f}s)", flush=True)
                    continue
                prompts = prompts_for(shape, config, seed=k + 1, limit=limit)
                params = params_for(len(prompts), config["vocab_size"])
                if shape == "abort":
                    got, want = generate_with_aborts(ours, prompts, params), generate_with_aborts(ref, prompts, params)
                elif shape == "prefix-again":
                    first = generate(ours, prompts, params)
                    got, want = generate(ours, prompts, params), first  # the second run hits the prefix cache
                    ok, note = compare(got, want, prompts, params, ref)
                    if ok:
                        got, want = first, generate(ref, prompts, params)
                else:
                    got, want = generate(ours, prompts, params), generate(ref, prompts, params)
                ok, note = compare(got, want, prompts, params, ref)
                row[shape] = ("pass" if ok else "FAIL") + f" ({note}, {time.time() - t1:.1f}s)"
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row[shape] = f"CRASH {type(exc).__name__}: {str(exc)[:160]}"
            finally:
                signal.alarm(0)
            print(f"[{name}] {shape}: {row[shape]}", flush=True)
        if hf is not None:  # float32 prompt logits of the plugin vs transformers'
            try:
                p = prompts_for("b3-blocks", config, seed=77, limit=limit)[2]
                with torch.no_grad():
                    want = hf(torch.tensor([p])).logits[0].double()
                got = ours.engine.prompt_logits(p).double().cpu()
                d = float((got - want).abs().max() / want.std())
                row["hf-f32"] = ("pass" if d < 1e-3 else "FAIL") + f" (max |dlogit|/std {d:.1e})"
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row["hf-f32"] = f"CRASH {type(exc).__name__}: {str(exc)[:160]}"
            print(f"[{name}] hf-f32: {row['hf-f32']}", flush=True)
        del ours
        if args.no_bf16:
            return row
        # bf16: the plugin's prompt logits finite and near the float32 reference's
        signal.alarm(args.cell_timeout)
        try:
            bkw = dict(kw, dtype="bfloat16", max_num_seqs=8)
            b16 = LLM(str(path), **bkw)
            prompts = prompts_for("b7", config, seed=99, limit=min(limit, 600))
            b16ref = LLM(str(path), **bkw, **REFERENCE)  # the builtin path in bf16: what rounding alone costs
            worst, agree, agree_ref, total = 0.0, 0, 0, 0
            for p in prompts[:4]:
                a, b = b16.engine.prompt_logits(p).double(), ref.engine.prompt_logits(p).double()
                c = b16ref.engine.prompt_logits(p).double()
                if not torch.isfinite(a).all():
                    raise ValueError("non-finite bf16 logits")
                worst = max(worst, float((a - b).abs().max() / b.std()))
                agree, total = agree + int((a.argmax(-1) == b.argmax(-1)).sum()), total + len(p)
                agree_ref += int((c.argmax(-1) == b.argmax(-1)).sum())
            out = generate(b16, prompts, params_for(len(prompts), config["vocab_size"]))
            assert all(len(o) for o in out)
            ok = agree >= agree_ref - 0.05 * total
            row["bf16"] = ("pass" if ok else "FAIL") + (f" (argmax = float32 reference at {agree}/{total} positions, "
                                                        f"builtin bf16 {agree_ref}/{total},"
                                                        f" max |dlogit|/std {worst:.2f})")  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            row["bf16"] = f"CRASH {type(exc).__name__}: {str(exc)[:160]}"
        finally:
            signal.alarm(0)
        print(f"[{name}] bf16: {row['bf16']} ({time.time() - t0:.1f}s in all)", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--shapes", default=None, help="comma list (default: 6 fixed + 2 rotating per config)")
    ap.add_argument("--full", action="store_true", help="every config x every shape")
    ap.add_argument("--tiny", action="store_true", help="tiny widths and short prompts (CPU plumbing check)")
    ap.add_argument("--blocks", type=int, default=1500)
    ap.add_argument("--cell-timeout", type=int, default=240)
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-prompt", type=int, default=5000, help="cap on prompt lengths")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 engines")
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="CPU: the plugin's kernels in Triton's interpreter instead of the builtin path",
    )
    ap.add_argument(
        "--jobs", type=int, default=1, help="configs in this many processes at once (Triton compiles on the CPU)"
    )
    ap.add_argument(
        "--index", type=int, default=0, help=argparse.SUPPRESS
    )  # a worker's first config's place (rotation)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the parent prints the table
    args = ap.parse_args(argv)
    if args.interpret:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        plugin_on_the_cpu()
    signal.signal(signal.SIGALRM, _alarm)
    names = args.configs.split(",")
    table = {}
    if args.jobs > 1 and len(names) > 1:
        import subprocess

        tmp = Path(tempfile.mkdtemp())
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        workers = []
        for j in range(min(args.jobs, len(names))):
            mine = names[j :: args.jobs]
            out = tmp / f"w{j}.json"
            cmd = [
                sys.executable,
                __file__,
                *rest,
                "--jobs",
                "1",
                "--configs",
                ",".join(mine),
                "--json",
                str(out),
                "--index",
                str(j),
                "--worker",
            ]
            workers.append((mine, out, subprocess.Popen(cmd)))
        for mine, out, proc in workers:
            proc.wait()
            part = json.loads(out.read_text()) if out.exists() else {}
            for name in mine:
                table[name] = part.get(name, {"build": f"CRASH worker exited {proc.returncode}"})
        table = {n: table[n] for n in names}
        names = []
    for i, name in enumerate(names, start=args.index):
        if args.shapes:
            shapes = args.shapes.split(",")
        elif args.full:
            shapes = list(SHAPES)
        else:
            shapes = DEFAULT_SHAPES + [ROTATE[(2 * i) % len(ROTATE)], ROTATE[(2 * i + 1) % len(ROTATE)]]
        table[name] = check_config(name, shapes, args)
        if args.json:  # after every config: a worker killed later still reports what it did
            Path(args.json).write_text(json.dumps(table, indent=1))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.worker:
        return 0
    cols = [c for c in ["plugin", *SHAPES, "hf-f32", "bf16", "build"] if any(c in r for r in table.values())]
    print("\n| config | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, r in table.items():
        print(f"| {name} | " + " | ".join(r.get(c, "-").split(" (")[0] for c in cols) + " |")
    failed = [
        f"{n}/{c}: {v}" for n, r in table.items() for c, v in r.items() if not (v.startswith("pass") or v == "ok")
    ]
    print("\nfailed:" if failed else "\nall cells passed", *failed, sep="\n")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
