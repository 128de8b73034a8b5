"""docs/grafana/deepinfer.json against a live server: every series a panel (or the model
variable) queries is a sample of ``GET /metrics``, read by prometheus_client's own parser, with
the labels the query groups or filters by."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from serve_harness import MODEL

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "deepinfer.json"
SERIES = re.compile(r"deepinfer:[a-z0-9_]+")
LABELS = re.compile(r"\b(?:by|without) \(([^)]*)\)|\{([^}]*)\}")


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_panel_queries_metrics_the_server_exports(served):
    from prometheus_client.parser import text_string_to_metric_families

    # a finished request, so that counters with extra labels (finish reason) have a sample
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=120).status_code == 200
    text = httpx.get(f"{served.base_url}/metrics", timeout=10).text
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)

    dashboard = json.loads(DASHBOARD.read_text())
    assert len(dashboard["panels"]) >= 10
    for panel in dashboard["panels"]:
        assert panel.get("targets"), panel["title"]
    used = set()
    for expr in _queries(dashboard):
        names = SERIES.findall(expr)
        assert names, expr
        for name in names:
            assert name in samples, f"{name} (in {expr!r}) is not on /metrics"
            used.add(name)
        for by, selector in LABELS.findall(expr):
            wanted = {label.strip() for label in by.split(",") if label.strip()}
            wanted |= {m.group(1) for m in re.finditer(r"(\w+)\s*=~?", selector)}
            for name in names:
                missing = wanted - samples[name] - ({"le"} if name.endswith("_bucket") else set())
                assert not missing, f"{expr!r}: {name} has no label {missing}"
    # every metric the server documents has a panel
    families = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in samples if n.startswith("deepinfer:")}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert families <= shown, families - shown
