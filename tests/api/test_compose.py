"""The compose stack exposes only what users call (the API, Grafana's login), takes every
credential from the environment with no default, and protects /metrics with a token that
Prometheus is given for its scrape."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
INTERNAL = ("postgres", "redis", "minio", "minio-bucket", "fleet", "migrate", "worker", "scheduler", "prometheus")
CREDENTIAL = re.compile(r"PASSWORD|SECRET|_KEY|TOKEN|ROOT_USER")
REQUIRED = re.compile(r"^\$\{[A-Z0-9_]+:\?[^}]*\}$")


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def test_internal_services_publish_no_port() -> None:
    services = _compose()["services"]
    for name in INTERNAL:
        assert not services[name].get("ports"), f"{name} publishes {services[name]['ports']}"
        assert not services[name].get("network_mode"), name  # never the host's network
    assert services["api"]["ports"] == ["8080:8080"]


def test_no_credential_has_a_default() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    # ${VAR:-default} or ${VAR-default} for a credential would start a stack with a known secret.
    defaulted = [
        m.group(0) for m in re.finditer(r"\$\$?\{([A-Z0-9_]+):?-[^}]*\}", text) if CREDENTIAL.search(m.group(1))
    ]
    assert defaulted == []
    for name, service in _compose()["services"].items():
        environment = service.get("environment") or {}
        for key, value in environment.items():
            if CREDENTIAL.search(key) and not key.endswith("_FILE"):
                assert REQUIRED.match(str(value)), f"{name}: {key}={value!r} must be ${{VAR:?...}}"
    env = _compose()["x-backfill-env"]
    for key in ("BACKFILL_DATABASE_URL", "BACKFILL_BROKER_URL", "BACKFILL_REDIS_URL"):
        # The password inside each URL comes from the environment too.
        assert re.search(r"://[^@]*:\$\{[A-Z0-9_]+:\?[^}]*\}@", env[key]), f"{key}={env[key]!r}"


def test_metrics_need_a_token_and_prometheus_sends_it() -> None:
    compose = _compose()
    assert REQUIRED.match(compose["x-backfill-env"]["BACKFILL_METRICS_TOKEN"])
    assert compose["secrets"]["backfill_metrics_token"] == {"environment": "BACKFILL_METRICS_TOKEN"}
    assert "backfill_metrics_token" in compose["services"]["prometheus"]["secrets"]
    scrape = yaml.safe_load((ROOT / "prometheus/prometheus.yml").read_text())["scrape_configs"]
    (job,) = [j for j in scrape if j["job_name"] == "backfill"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/backfill_metrics_token"}
    # The app reads the token under that name (tests/api/test_ops.py: 401 without it).
    from backfill.storage.settings import Settings

    assert "metrics_token" in Settings.model_fields
