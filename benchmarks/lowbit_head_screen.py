"""Would a cheaper screening pass make SmolLM2's greedy LM head exact and faster? (issue 11)

    .venv/bin/python benchmarks/lowbit_head_screen.py --requests 32 --tokens 40

The idea: multiply every vocabulary row by activations rounded to L levels per 32-block (int8
or coarser: `vpmaddubsw`, 32 products an instruction), bound each row's error, and recompute
with the head's own kernel only the rows whose upper bound reaches the best lower bound, so the
argmax stays bit-for-bit. This script measures how many rows such a screen would leave, on the
real hidden states of SmolLM2's decode steps (the default engine, ``--requests`` greedy
requests) and its real Q8_0 head, emulated in float64 (no kernel is built):

- the screen's error against the exact dot product (ignoring float rounding, a few ulps),
  per row and token at most ``sum_b |d_b| * L1(q_b) * amax_b / (2L)`` (``S / 2L``; the head's
  own int16 rounding adds ``S / 65534``); a bound of 0.51 / L + 1e-4 times S is used;
- "tight": S per (row, token), an 18-long dot product (a [V, 18] x [18, M] GEMM per step);
  "loose": the row's sum of |d_b| L1(q_b) times the token's largest block amax (no GEMM).

The figures (benchmarks/README.md, cpu10) say why no screen was built: with L = 63, the
finest level count for which `vpmaddubsw` of unsigned (offset) 8-bit weights cannot saturate,
the screen leaves few rows but needs one `vpmaddwd` per `vpmaddubsw` to widen its int16 pair
sums, as many multiplies as the int16 head itself; coarser levels (L <= 31, two or more
`vpmaddubsw` summed in int16 first) leave hundreds to thousands of rows per token. With
AVX512-VNNI's `vpdpbusd` (L = 127, no saturation) the screen was built: lowbit/head_screen.c,
benchmarks/README.md, head5 (its AVX2 form, exact through `vpsignb`, does not pay).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cpu_throughput import build_prompts  # noqa: E402


def hidden_states(requests: int, tokens: int) -> tuple[torch.Tensor, object]:
    """The final-normed hidden rows the head saw in a greedy run, and the head's packed weight."""
    from deepinfer_core import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", device="cpu", max_num_seqs=requests, kv_cache_blocks=requests * 3)
    model = llm.engine.model
    model.fused_greedy = False  # every step through compute_logits
    seen: list[torch.Tensor] = []
    compute = model.compute_logits
    model.compute_logits = lambda h: seen.append(h.clone()) or compute(h)
    llm.generate(
        build_prompts(requests, 128), SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False
    )
    return torch.cat(seen), model.model.embed_tokens.weight_q


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--rows", type=int, default=256, help="hidden rows checked (spread over the run)")
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[127, 63, 31, 15])
    args = parser.parse_args()
    hidden, w = hidden_states(args.requests, args.tokens)
    step = max(1, hidden.shape[0] // args.rows)
    x = hidden[::step][: args.rows].double()
    qs, d = w.qs.double(), w.d.double()  # [V, nb, 32], [V, nb]
    V, nb, _ = qs.shape
    exact = x @ (qs * d[..., None]).reshape(V, -1).T
    xb = x.reshape(x.shape[0], nb, 32)
    amax = xb.abs().amax(-1)  # [T, nb]
    c = qs.abs().sum(-1) * d.abs()  # [V, nb]
    bounds = {"tight": amax @ c.T, "loose": amax.amax(-1, keepdim=True) * c.sum(-1)[None]}
    top2 = exact.topk(2, dim=-1).values
    print(
        f"SmolLM2-135M Q8_0 head ({V} x {nb * 32}), {x.shape[0]} hidden rows of a {args.requests}-request greedy run; "
        f"top-1 minus top-2 logit: median {(top2[:, 0] - top2[:, 1]).median():.3f}, min {(top2[:, 0] - top2[:, 1]).min():.4f}\n"
    )
    print("| levels L | bound | largest error / S (proven <= 0.5 / L) | rows left per token: mean | p99 | max |")
    print("|---:|---|---:|---:|---:|---:|")
    for L in args.levels:
        s = amax / L
        v = torch.round(xb / s[..., None].clamp_min(1e-30))
        y = (v * s[..., None]).reshape(x.shape[0], -1) @ (qs * d[..., None]).reshape(V, -1).T
        for name, S in bounds.items():
            err = ((y - exact).abs() / S).max().item()
            margin = S * (0.51 / L + 1e-4)
            left = (y + margin >= (y - margin).max(dim=-1, keepdim=True).values).sum(-1).double()
            print(f"| {L} | {name} | {err:.4f} | {left.mean():.1f} | {left.quantile(0.99):.0f} | {left.max():.0f} |")


if __name__ == "__main__":
    main()
