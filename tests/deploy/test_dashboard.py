"""The provisioned Grafana dashboard: well-formed, uses the provisioned data source, and queries only metrics
that retopk_server.metrics exports (read from an exposition after every hook ran once; the live check
against a running server is tests/server/test_metrics_live.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from retopk_core.methods.base import Path as CorePath
from retopk_server.engine.requests import Timings, Usage
from retopk_server.metrics import MetricsObserver
from retopk_server.runtime.memory import MemoryUsage
from retopk_server.runtime.stats import StepStats, StepStatsBatch

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "retopk.json"
METRIC_NAME = re.compile(r"\bretopk_[A-Za-z0-9_]+")


def queries(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)] + [
            q for k, v in node.items() if k not in ("expr", "definition") for q in queries(v)]
    if isinstance(node, list):
        return [q for item in node for q in queries(item)]
    return []


def exported_sample_names() -> set[str]:
    """Sample names after every observer hook has fired once (so every labelled metric has a child)."""
    observer = MetricsObserver("m")
    request = SimpleNamespace(method=None)
    info = SimpleNamespace(architecture="A", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, device="cpu",
                           backend="torch", default_method=SimpleNamespace(name="retopk"), weight_format="int4",
                           kv_dtype="bfloat16")
    observer.on_start(info, lambda: MemoryUsage(kv_used=1, kv_reserved=2, method_state_used=1, method_state_reserved=2))
    observer.on_queue_wait(request, 0.01)
    observer.on_prefill(request, 5, 0.02)
    observer.on_first_token(request, 0.03)
    observer.on_token(request)
    observer.on_token(request)
    path = torch.tensor([[0, 1]], dtype=torch.int8)
    observer.on_step([request], 0.01, StepStatsBatch.of_rows([StepStats(
        path, torch.tensor([[0.9, 0.2]]), torch.tensor([[20, 50]], dtype=torch.int32), 0.001, num_kv_heads=1)]))
    observer.on_load(0, 1, 0)
    observer.on_finish(request, "LENGTH", Usage(5, 2, 7), Timings(total_s=0.1))
    observer.on_error(None, "INVALID_ARGUMENT")
    observer.on_rpc("Generate", "OK", 0.1)
    text = generate_latest(observer.metrics.registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_dashboard_is_well_formed_and_uses_the_provisioned_data_source():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "retopk" and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            if "retopk_" in target["expr"] and "by (le" not in target["expr"]:
                assert '{model=~"$model"' in target["expr"], target["expr"]


def test_dashboard_queries_only_exported_metrics():
    used = {name for q in queries(json.loads(DASHBOARD.read_text())) for name in METRIC_NAME.findall(q)}
    exported = exported_sample_names()
    assert len(used) >= 15
    assert used <= exported, sorted(used - exported)


def test_heatmaps_group_a_layer_by_head_matrix():
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    for title in ("Reuse rate, layer x head", "Exact-path share, layer x head"):
        panel = panels[title]
        assert "sum by (layer, head)" in panel["targets"][0]["expr"]
        matrix = next(t for t in panel["transformations"] if t["id"] == "groupingToMatrix")["options"]
        assert (matrix["rowField"], matrix["columnField"]) == ("layer", "head")


def test_exact_share_panels_count_every_path_that_reads_a_kv_group():
    """The dashboard's exact-path regex names exactly the paths that read a whole KV group (listed here:
    fallback, refresh, promoted, exact, dense), so promoted heads are not counted as reuse."""
    full_read = {CorePath.FALLBACK, CorePath.REFRESH, CorePath.PROMOTED, CorePath.EXACT, CorePath.DENSE}
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    for title in ("Exact-path share", "Exact-path share, layer x head"):
        (regex,) = re.findall(r'path=~"([^"]+)"', panels[title]["targets"][0]["expr"])
        assert set(regex.split("|")) == {p.name.lower() for p in full_read}, title


def test_group_read_panels_divide_reads_by_steps_overall_and_per_layer():
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    reads = 'rate(retopk_kv_group_reads_total{model=~"$model"}[$__rate_interval])'
    steps = 'rate(retopk_kv_group_steps_total{model=~"$model"}[$__rate_interval])'
    overall = f"sum({reads}) / sum({steps})"
    assert [t["expr"] for t in panels["Group-read rate"]["targets"]] == [overall]
    by_layer = [t["expr"] for t in panels["Group-read rate by layer"]["targets"]]
    assert by_layer == [f"sum by (layer) ({reads}) / sum by (layer) ({steps})", overall]
