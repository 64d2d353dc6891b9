"""Operators' routes in-process on the real Postgres and Redis with a local object directory:
`/metrics` in Prometheus's text format, `/ready` naming what failed, and the access log."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from backfill.api.access_log import AccessLog
from backfill.storage.process_state import reset as reset_process_state
from tests.api.conftest import ApiEnv, CheckedClient, Team
from tests.api.test_batches import create

CLOSED_PORT_DB = "postgresql+psycopg://postgres@127.0.0.1:9/nothing"  # the discard port: refused at once


@pytest.fixture
def settings_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Change settings for one test; the next test builds them again from the package's env."""
    yield monkeypatch
    reset_process_state()


def _unlisted(api: CheckedClient, path: str, **kwargs: Any) -> Any:
    """/metrics and /health are not in the OpenAPI document (text, probes): skip the check."""
    return TestClient.request(api, "GET", path, **kwargs)


def _scrape(api: CheckedClient) -> dict[str, list[Sample]]:
    r = _unlisted(api, "/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(r.text)}


def _value(samples: list[Sample], **labels: str) -> float:
    return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_parse_and_carry_the_families(api: CheckedClient, team: Team) -> None:
    before = _scrape(api)
    create(api, team)
    assert api.get("/v1/batches", headers=team.headers).status_code == 200
    after = _scrape(api)

    for family in ("backfill_batches", "backfill_lines", "backfill_slo_ttft_seconds", "backfill_slo_itl_seconds"):
        assert family in after, sorted(after)
    assert _value(after["backfill_metrics_database_up"]) == 1
    assert (
        _value(after["backfill_batches"], status="validating")
        >= _value(before["backfill_batches"], status="validating") + 1
    )
    assert {s.labels["state"] for s in after["backfill_lines"]} == {"pending", "running", "succeeded", "failed"}
    assert _value(after["backfill_slo_itl_seconds"]) == 0.05
    # The API's own requests, by route template (never the id in the path).
    requests = after["backfill_http_requests"]
    assert _value(requests, method="POST", route="/v1/batches", status="200") >= 1
    assert _value(requests, method="GET", route="/v1/batches", status="200") >= 1
    durations = after["backfill_http_request_duration_seconds"]
    assert _value([s for s in durations if s.name.endswith("_count")], method="GET", route="/v1/batches") >= 1


def test_metrics_ask_for_the_token_when_one_is_set(api: CheckedClient, settings_env: pytest.MonkeyPatch) -> None:
    settings_env.setenv("BACKFILL_METRICS_TOKEN", "scrape-token-0123456789")
    reset_process_state()
    assert _unlisted(api, "/metrics").status_code == 401
    assert _unlisted(api, "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = _unlisted(api, "/metrics", headers={"Authorization": "Bearer scrape-token-0123456789"})
    assert ok.status_code == 200


def test_ready_checks_every_dependency(api: CheckedClient, api_env: ApiEnv, settings_env: pytest.MonkeyPatch) -> None:
    settings_env.setenv("BACKFILL_REDIS_URL", api_env.redis_url)
    reset_process_state()
    r = api.get("/ready")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ready" and body["failed"] == []
    assert {name: c["status"] for name, c in body["checks"].items()} == {
        "database": "ok",
        "broker": "ok",
        "redis": "ok",
        "object_store": "ok",
    }
    documented = api.fastapi_app.openapi()["paths"]["/ready"]["get"]["responses"]
    assert {"200", "503"} <= set(documented)
    assert _unlisted(api, "/health").status_code == 200  # liveness stays apart


def test_ready_names_the_database_when_it_is_down(api: CheckedClient, settings_env: pytest.MonkeyPatch) -> None:
    settings_env.setenv("BACKFILL_DATABASE_URL", CLOSED_PORT_DB)
    reset_process_state()
    r = api.get("/ready")
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["status"] == "not_ready" and body["failed"] == ["database"]
    assert body["checks"]["database"]["status"] == "failed"
    assert body["checks"]["broker"]["status"] == "ok"
    assert _unlisted(api, "/health").status_code == 200  # alive, just not ready


def test_ready_tells_what_went_wrong_only_to_an_admin(
    api: CheckedClient, api_env: ApiEnv, team: Team, settings_env: pytest.MonkeyPatch
) -> None:
    # The broker's URL carries a host, a user and a password: the error text would show some.
    settings_env.setenv("BACKFILL_BROKER_URL", "redis://svc-user:hunter2-secret@127.0.0.1:9/0")
    reset_process_state()
    anonymous, as_team = api.get("/ready"), api.get("/ready", headers=team.headers)
    for r in (anonymous, as_team):
        assert r.status_code == 503 and r.json()["failed"] == ["broker"], r.text
        assert r.json()["checks"]["broker"] == {
            "status": "failed",
            "duration_ms": r.json()["checks"]["broker"]["duration_ms"],
            "error": None,
        }
        assert "127.0.0.1" not in r.text and "svc-user" not in r.text and "Error" not in r.text
    admin = api.get("/ready", headers={"Authorization": f"Bearer {api_env.admin_key}"})
    assert admin.status_code == 503 and admin.json()["checks"]["broker"]["error"], admin.text

    # Only the configured admin key counts on /ready (never a database lookup): so also while the database is down.
    settings_env.setenv("BACKFILL_DATABASE_URL", CLOSED_PORT_DB)
    reset_process_state()
    assert api.get("/ready").json()["checks"]["database"]["error"] is None
    admin = api.get("/ready", headers={"Authorization": f"Bearer {api_env.admin_key}"})
    assert "OperationalError" in admin.json()["checks"]["database"]["error"], admin.text


def test_the_access_log_has_a_line_per_request_and_never_a_key(
    api: CheckedClient, team: Team, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="backfill.access")
    batch = create(api, team)
    api.get(f"/v1/batches/{batch['id']}?api_key={team.key}", headers=team.headers)
    api.get("/v1/batches", headers={"Authorization": "Bearer sk-not-a-key-0000000000"})
    api.get("/no/such/route", headers=team.headers)

    lines = [r for r in caplog.records if r.name == "backfill.access"]
    fields = [r.access for r in lines]  # type: ignore[attr-defined]
    assert {"method": "GET", "route": "/v1/batches/{batch_id}", "status": 200}.items() <= fields[-3].items()
    assert {"method": "GET", "route": "/v1/batches", "status": 401}.items() <= fields[-2].items()
    assert fields[-1]["route"] == "unmatched" and fields[-1]["path"] == "/no/such/route"
    assert all(f["duration_ms"] >= 0 for f in fields)
    for record in lines:
        text = record.getMessage() + repr(record.__dict__)
        assert team.key not in text and "sk-not-a-key" not in text
        assert "authorization" not in text.lower()


def test_the_access_log_names_the_team(api: CheckedClient, team: Team, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="backfill.access")
    api.get("/v1/batches", headers=team.headers)
    (line,) = [r for r in caplog.records if r.name == "backfill.access"]
    assert line.access["team_id"] == team.project_id.removeprefix("proj_")  # type: ignore[attr-defined]


def test_the_access_log_takes_the_team_from_the_request_state(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    app.add_middleware(AccessLog)

    @app.get("/things/{thing_id}")
    def thing(thing_id: str, request: Request) -> dict[str, str]:
        request.state.team_id = "team-1"  # what authentication leaves for the log
        return {"id": thing_id}

    caplog.set_level(logging.INFO, logger="backfill.access")
    with TestClient(app) as client:
        assert client.get("/things/42").status_code == 200
    (line,) = [r for r in caplog.records if r.name == "backfill.access"]
    assert line.access["team_id"] == "team-1" and line.access["route"] == "/things/{thing_id}"  # type: ignore[attr-defined]
    assert line.getMessage().startswith("GET /things/{thing_id} 200 ")
