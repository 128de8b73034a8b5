"""The benchmarks folder stays navigable: every script is in the README's index, every figure of
record names its script, machine, date, commit and peer, and docs/performance.md quotes each one.
(Tests never time anything; these only read files.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TOPICS = ("cpu", "gpu", "serve", "kv", "kernels", "ep", "spec", "cluster")
FIELDS = ("benchmark", "script", "command", "machine", "date", "commit", "peer", "rows")


def scripts() -> list[Path]:
    return sorted(p for topic in TOPICS for p in (BENCH / topic).iterdir() if p.suffix in (".py", ".c"))


def results() -> list[Path]:
    return sorted((BENCH / "results").glob("*.json"))


def test_every_script_is_in_a_topic_folder_and_the_index():
    loose = sorted(p.name for p in BENCH.glob("*.py") if p.name not in ("bench_json.py", "report.py"))
    assert loose == [], f"scripts outside the topic folders {TOPICS}: {loose}"
    index = (BENCH / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in scripts() if f"`{p.name}`" not in index]
    assert missing == [], f"scripts missing from benchmarks/README.md: {missing}"


@pytest.mark.parametrize("path", results(), ids=lambda p: p.stem)
def test_each_result_names_its_run(path: Path):
    result = json.loads(path.read_text(encoding="utf-8"))
    absent = [f for f in FIELDS if not result.get(f)]
    assert absent == [], f"{path.name}: empty or missing {absent}"
    assert result["benchmark"] == path.stem
    assert (ROOT / result["script"]).is_file(), f"{path.name}: no script {result['script']}"
    assert all(isinstance(row, dict) and row for row in result["rows"])


def test_every_benchmark_has_a_figure_quoted_on_the_performance_page():
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    have = {p.stem for p in results()}
    helpers = {"graph_timing"}  # imported by the GEMV scripts, measures nothing alone
    without = sorted(p.stem for p in scripts() if p.stem not in have and p.stem not in helpers)
    assert without == [], f"benchmarks without a results file: {without}"
    unquoted = sorted(p.stem for p in results() if f"{p.stem}." not in page)
    assert unquoted == [], f"results not on docs/performance.md: {unquoted}"


def test_report_tables_a_result():
    spec = importlib.util.spec_from_file_location("bench_report", BENCH / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    table = report.table({"rows": [{"requests": 1, "tok_s": 2.5}, {"requests": 8, "error": "timed out"}]})
    assert table.splitlines() == [
        "| requests | tok_s | error |",
        "|---|---|---|",
        "| 1 | 2.5 |  |",
        "| 8 |  | timed out |",
    ]
