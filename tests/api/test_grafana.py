"""The Grafana dashboard, its provisioning and the Prometheus scrape config hold together: the JSON
is well formed, every panel queries the provisioned datasource, and every metric it names is one
backfill defines. (tests/e2e/test_up_state.py checks the names against a real scrape.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import Counter, Histogram

from backfill.api.access_log import http_metrics
from backfill.api.routes.ops import DatabaseGauges
from backfill.jobs.metrics import usage_metrics
from backfill.scheduler.metrics import scheduler_metrics
from tests.api.conftest import ApiEnv

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "grafana" / "dashboards" / "backfill.json"


def _yaml(path: str) -> Any:
    return yaml.safe_load((ROOT / path).read_text())


def _sample_names(metric: Any) -> set[str]:
    name = metric._name
    if isinstance(metric, Counter):
        return {name + "_total"}
    if isinstance(metric, Histogram):
        return {name + "_bucket", name + "_count", name + "_sum"}
    return {name}


def defined_sample_names() -> set[str]:
    metrics: list[Any] = [*vars(scheduler_metrics()).values(), *vars(usage_metrics()).values()]
    metrics += vars(http_metrics()).values()
    names = {n for m in metrics for n in _sample_names(m)}
    return names | {family.name for family in DatabaseGauges().collect()}


def test_the_dashboard_is_well_formed_and_uses_the_provisioned_datasource(api_env: ApiEnv) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    (datasource,) = _yaml("grafana/provisioning/datasources/prometheus.yml")["datasources"]
    panels = dashboard["panels"]
    assert dashboard["uid"] == "backfill" and len(panels) > 10
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert re.search(r"\bbackfill_[a-z0-9_]+", target["expr"]), target
            assert target["datasource"]["uid"] == datasource["uid"]

    names = {n for p in panels for t in p.get("targets", []) for n in re.findall(r"\bbackfill_[a-z0-9_]+", t["expr"])}
    assert names - defined_sample_names() == set()


def test_prometheus_scrapes_the_api_and_grafana_loads_the_dashboard() -> None:
    scrape = _yaml("prometheus/prometheus.yml")["scrape_configs"]
    targets = {t for job in scrape for group in job["static_configs"] for t in group["targets"]}
    assert {"api:8080", "fleet:8000"} <= targets
    (provider,) = _yaml("grafana/provisioning/dashboards/backfill.yml")["providers"]
    compose = _yaml("docker-compose.yml")["services"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in compose["grafana"]["volumes"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in compose["prometheus"]["volumes"]
    # api, worker and scheduler share the metrics directory that /metrics adds up.
    for name in ("api", "worker", "scheduler"):
        assert "metrics:/var/lib/backfill/metrics" in compose[name]["volumes"], name
        assert compose[name]["environment"]["BACKFILL_METRICS_DIR"] == "/var/lib/backfill/metrics"
