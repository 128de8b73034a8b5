"""Start-up of the DeepSeek-family models: process start to the first generated token of a tiny
DeepSeek-V3 (transformers' ``DeepseekV3Config``, random weights) and a tiny DeepSeek-V4
(``deepinfer_core.testing.v4_checkpoint``, the released layout: FP8 weights, MXFP4 experts), on
the CPU, from token ids (neither has a tokenizer), and whether the process imported sympy.
``--before REV`` times another revision's code in the same run (as ``startup.py`` does); the
checkpoints are written once and shared. What is timed is mostly ``import torch`` and model
construction: the models are tiny, so their weights take no time to read.

    .venv/bin/python benchmarks/cpu/startup_moe.py --repeats 5 --before 29eba82

Not part of the test suite: tests never time things.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from startup import source_tree  # noqa: E402  (the same git-archive helper)

CHILD = r"""
import sys
from deepinfer_core import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", kv_cache_blocks=8, block_size=64, max_num_seqs=1)
for out in llm.stream({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)):
    sys.stdout.write(" ".join(map(str, out.outputs[0].token_ids)) + "\n")
    sys.stdout.flush()
sys.stderr.write(f"SYMPY {'sympy' in sys.modules}\n")
"""


def write_models(work: str) -> dict[str, str]:
    import torch
    import transformers

    from deepinfer_core.testing.v4_checkpoint import write_tiny_v4_checkpoint

    v3 = os.path.join(work, "v3")
    cfg = transformers.DeepseekV3Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=24,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(v3)
    v4 = os.path.join(work, "v4")
    write_tiny_v4_checkpoint(v4)
    return {"DeepSeek-V3 (tiny)": v3, "DeepSeek-V4 (tiny)": v4}


def time_child(model: str, env: dict, cwd: str) -> tuple[float, bool, str]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, model], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    first = proc.stdout.readline()
    elapsed = time.perf_counter() - start
    rest, err = proc.communicate()
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"child failed ({proc.returncode}): {err.decode()[-2000:]}")
    return elapsed, "SYMPY True" in err.decode(), (first + rest).decode().split("\n")[-2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", metavar="REV")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="deepinfer-startup-moe-")
    try:
        models = write_models(work)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DEEPINFER_LOG_LEVEL": "warning", "PYTHONPATH": ""}
        codes = {"now": env}
        if args.before:
            tree = os.path.join(work, "before")
            os.makedirs(tree)
            codes[args.before] = {**env, "PYTHONPATH": source_tree(args.before, tree)}
        results: dict[tuple[str, str], list] = {(m, c): [] for m in models for c in codes}
        for _ in range(args.repeats):
            for model, code in results:  # alternating, so load drift hits all alike
                results[(model, code)].append(time_child(models[model], codes[code], work))
        print(f"\n{os.cpu_count()} CPUs, 1 thread, load {os.getloadavg()[0]:.1f} at the end, median of {args.repeats}")
        print("| model | code | first token s | runs | imported sympy | tokens |")
        print("|---|---|---:|---|---|---|")
        for (model, code), runs in results.items():
            times = [r[0] for r in runs]
            print(
                f"| {model} | {code} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} | "
                f"{'yes' if any(r[1] for r in runs) else 'no'} | {runs[0][2]} |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
