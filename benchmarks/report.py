"""The charts of docs/performance.md, from the benchmarks' JSON results.

    pip install -e '.[bench]'                      # matplotlib
    python benchmarks/report.py                    # benchmarks/results/*.json -> docs/performance/*.png
    python benchmarks/report.py --results DIR --out DIR --tables   # other results; also print markdown tables

Each JSON file is one run of one benchmark (``--json PATH`` on cpu_throughput, gpu_throughput, serve_load and
kv_cache; the schema is in benchmarks/bench_json.py). A chart is drawn for each benchmark it knows that has a
file; the others are only tabled with ``--tables``. The PNGs are small (about 100 dpi) so they can be committed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
COLORS = {"deepinfer": "#1f77b4", "peer": "#ff7f0e", "other": "#7f7f7f", "third": "#2ca02c"}


def load(results_dir: str) -> dict[str, dict]:
    """Every ``*.json`` in the folder, keyed by its ``benchmark`` field."""
    out = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            result = json.load(f)
        out[result["benchmark"]] = result
    return out


def caption(result: dict) -> str:
    machine = result["machine"].split(";")[0]
    machine = machine if len(machine) <= 80 else machine[:77] + "..."
    return f"{machine}; {result['date']}; commit {result['commit']}"


def cpu_throughput(result: dict, plt):
    rows = [r for r in result["rows"] if not r.get("error")]
    levels = sorted({r["concurrency"] for r in rows})
    engines = [e for e in ("deepinfer", "llamacpp", "transformers") if any(r["engine"] == e for r in rows)]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / len(engines)
    label = {"deepinfer": "deepinfer (default)", "llamacpp": "llama.cpp", "transformers": "transformers"}
    colors = {"deepinfer": COLORS["deepinfer"], "llamacpp": COLORS["peer"], "transformers": COLORS["other"]}
    for i, engine in enumerate(engines):
        got = {r["concurrency"]: r["tok_s"] for r in rows if r["engine"] == engine}
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(levels))]
        ax.bar(xs, [got.get(n, 0) for n in levels], width, label=label[engine], color=colors[engine])
    for j, n in enumerate(levels):
        ours = next((r["tok_s"] for r in rows if r["engine"] == "deepinfer" and r["concurrency"] == n), None)
        peer = next((r["tok_s"] for r in rows if r["engine"] == "llamacpp" and r["concurrency"] == n), None)
        if ours and peer:
            ax.annotate(f"{ours / peer:.2f}x", (j, max(ours, peer)), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(levels)), [str(n) for n in levels])
    ax.margins(y=0.12)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("CPU: SmolLM2-135M Q4_1, 128 + 128 tokens", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def gpu_throughput(result: dict, plt):
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    names = {"v3mini": "V3-mini bf16", "v3mini-fp8": "V3-mini FP8", "v4mini": "V4-mini bf16", "smollm2": "SmolLM2 bf16"}
    for model, name in names.items():
        rows = sorted((r for r in result["rows"] if r["model"] == model and r["requests"]), key=lambda r: r["requests"])
        if rows:
            ns = [r["requests"] for r in rows]
            ax.plot(ns, [1e3 * n / r["decode_ms"] for n, r in zip(ns, rows)], marker="o", label=f"deepinfer {name}")
        hf = [(r["requests"], r["transformers_decode_ms"]) for r in rows if r.get("transformers_decode_ms")]
        if hf:
            ax.plot(
                [n for n, _ in hf],
                [1e3 * n / ms for n, ms in hf],
                marker="s",
                linestyle="--",
                label=f"transformers {name}",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    levels = sorted({r["requests"] for r in result["rows"] if r["requests"]})
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens / s")
    ax.set_title("GPU decode throughput (cuda_sm100 plugin, H200)", fontsize=10)
    ax.legend(fontsize=7)
    return fig


def serve_throughput(result: dict, plt):
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    label = {"deepinfer": "deepinfer serve", "llamacpp": "llama.cpp server", "offline": "deepinfer offline LLM"}
    style = {"deepinfer": "-", "llamacpp": "-", "offline": ":"}
    for engine, name in label.items():
        rows = sorted((r for r in result["rows"] if r["engine"] == engine), key=lambda r: r["concurrency"])
        if rows:
            xs = [r["concurrency"] for r in rows]
            ax.plot(xs, [r["tok_s"] for r in rows], marker="o", linestyle=style[engine], label=name)
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in result["rows"]})
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("output tokens / s")
    ax.set_title("HTTP server throughput (SmolLM2-135M, CPU)", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def serve_latency(result: dict, plt):
    servers = [e for e in ("deepinfer", "llamacpp") if any(r["engine"] == e for r in result["rows"])]
    levels = sorted({r["concurrency"] for r in result["rows"]})
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for ax, metric, unit in ((axes[0], "ttft", "time to first token, ms"), (axes[1], "itl", "inter-token latency, ms")):
        width = 0.8 / (2 * len(servers))
        k = 0
        for engine in servers:
            rows = {r["concurrency"]: r for r in result["rows"] if r["engine"] == engine}
            for pct, alpha in (("p50", 1.0), ("p99", 0.5)):
                xs = [j + (k - (2 * len(servers) - 1) / 2) * width for j in range(len(levels))]
                key = f"{metric}_{pct}_ms"
                color = COLORS["deepinfer"] if engine == "deepinfer" else COLORS["peer"]
                name = "deepinfer" if engine == "deepinfer" else "llama.cpp"
                ax.bar(xs, [rows.get(n, {}).get(key, 0) for n in levels], width, alpha=alpha, color=color,
                       label=f"{name} {pct}")  # fmt: skip
                k += 1
        ax.set_xticks(range(len(levels)), [str(n) for n in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(unit)
    axes[0].legend(fontsize=7)
    fig.suptitle("HTTP server latency percentiles (client side)", fontsize=10)
    return fig


def kv_cache(result: dict, plt):
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    labels = [f"{r['prompt_tokens']:,} tokens\n{r.get('model', '')}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["miss_ttft_s"] for r in rows], 0.4, label="miss (computed)", color=COLORS["peer"])
    ax.bar([x + 0.2 for x in xs], [r["hit_ttft_s"] for r in rows], 0.4, label="hit (from the store)",
           color=COLORS["deepinfer"])  # fmt: skip
    for x, r in zip(xs, rows):
        ax.annotate(f"{r['miss_ttft_s'] / r['hit_ttft_s']:.1f}x", (x + 0.2, r["hit_ttft_s"]), ha="center", va="bottom",
                    fontsize=9)  # fmt: skip
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("time to first token, s (log)")
    ax.set_title("Persistent KV cache: TTFT in a fresh process, CPU, local store", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def v4_attention(result: dict, plt):
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["reference_ms"] for r in rows], 0.4, label="torch reference", color=COLORS["peer"])
    ax.bar([x + 0.2 for x in xs], [r["triton_ms"] for r in rows], 0.4, label="cuda_sm100 Triton",
           color=COLORS["deepinfer"])  # fmt: skip
    ax.set_xticks(list(xs), [f"{r['kind']}\n{r['shape']}" for r in rows], fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title("DeepSeek-V4 attention kernels, H200 (requests x new tokens)", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def cluster_sim(result: dict, plt):
    rows = [r for r in result["rows"] if "offline_vs_perfect" in r]
    sizes = sorted({r["replicas"] for r in rows})
    policies = [p for p in ("deepinfer", "least-loaded", "round-robin") if any(r["policy"] == p for r in rows)]
    colors = {"deepinfer": COLORS["deepinfer"], "least-loaded": COLORS["peer"], "round-robin": COLORS["other"]}
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        got = {r["replicas"]: r["offline_vs_perfect"] for r in rows if r["policy"] == policy}
        xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(sizes))]
        ax.bar(xs, [got.get(n, 0) for n in sizes], width, label=policy, color=colors[policy])
    ax.axhline(0.8, color="#555555", linewidth=0.8, linestyle="--")
    ax.annotate("goal 0.8", (len(sizes) - 0.5, 0.8), ha="right", va="bottom", fontsize=8, color="#555555")
    ax.set_xticks(range(len(sizes)), [f"{n:,}" for n in sizes])
    ax.set_ylim(0, 1)
    ax.set_xlabel("prefill replicas (simulated)")
    ax.set_ylabel("throughput / perfect balance")
    ax.set_title("Cluster router on an agent trace (DeepSeek's per-card costs)", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    return fig


CHARTS = {
    "cluster_sim": [("cluster_sim.png", cluster_sim)],
    "cpu_throughput": [("cpu_throughput.png", cpu_throughput)],
    "gpu_throughput": [("gpu_throughput.png", gpu_throughput)],
    "serve_load": [("serve_throughput.png", serve_throughput), ("serve_latency.png", serve_latency)],
    "kv_cache": [("kv_cache_ttft.png", kv_cache)],
    "v4_attention": [("v4_attention.png", v4_attention)],
}


def table(result: dict) -> str:
    """The rows as a markdown table (columns: the union of the rows' keys, in first-seen order)."""
    keys: list[str] = []
    for row in result["rows"]:
        keys += [k for k in row if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in result["rows"]:
        lines.append("| " + " | ".join("" if row.get(k) is None else str(row.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="folder of JSON results")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "performance"), help="folder for the PNGs")
    ap.add_argument("--tables", action="store_true", help="also print each result as a markdown table")
    args = ap.parse_args()
    try:
        import matplotlib
    except ImportError:
        print("report.py needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib)", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load(args.results)
    if not results:
        print(f"no JSON results in {args.results}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for name, result in results.items():
        for filename, draw in CHARTS.get(name, []):
            fig = draw(result, plt)
            fig.text(0.01, 0.01, caption(result), fontsize=6, color="#555555")
            fig.tight_layout(rect=(0, 0.03, 1, 1))
            path = os.path.join(args.out, filename)
            fig.savefig(path, dpi=100)
            plt.close(fig)
            print(f"wrote {os.path.relpath(path)}")
        if args.tables:
            print(f"\n### {name}\n\n`{result['command']}` ({result['machine']}; {result['date']}; {result['commit']})")
            print(f"peer: {result['peer']}\n\n{table(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
