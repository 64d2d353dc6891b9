"""The dashboard's page and JSON routes in-process, and its lease reader held to the real lease
stores (Redis and SQL): the API may not import the scheduler, so it reads the stores' layout."""

from __future__ import annotations

import secrets
import time

import pytest
from fastapi.testclient import TestClient

from backfill.api.routes import dashboard
from backfill.storage.leases import RedisLeaseStore, SqlLeaseStore, limit_key
from backfill.storage.settings import Settings, get_settings
from tests.api.conftest import ApiEnv, CheckedClient, Team
from tests.api.test_batches import create


def test_the_page_and_its_assets_are_served_under_a_strict_policy(api: CheckedClient) -> None:
    plain = TestClient(api.fastapi_app)  # the page is no API route: it is not in the OpenAPI document
    page = plain.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/app.js"' in page.text and "<script>" not in page.text  # no inline script
    for asset, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = plain.get(f"/dashboard/{asset}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.content
    for other in ("index.html", "..%2f..%2fapp.py", "nope.js"):
        assert plain.get(f"/dashboard/{other}").status_code == 404
    assert "innerHTML" not in plain.get("/dashboard/app.js").text  # server values go in as text only


def test_batches_are_scoped_to_the_team_or_all_for_an_admin(
    api: CheckedClient, team: Team, other_team: Team, admin_headers: dict[str, str]
) -> None:
    mine, theirs = create(api, team)["id"], create(api, other_team)["id"]
    own = api.get("/v1/dashboard/batches", headers=team.headers).json()
    assert own["admin"] is False and own["project_id"] == team.project_id
    assert [b["id"] for b in own["data"]] == [mine] and [t["project_id"] for t in own["teams"]] == [team.project_id]
    assert own["data"][0] | {"created_at": 0, "expires_at": 0} == {
        "id": mine,
        "project_id": team.project_id,
        "status": "validating",
        "endpoint": "/v1/chat/completions",
        "model": None,
        "created_at": 0,
        "expires_at": 0,
        "total": 0,
        "completed": 0,
        "failed": 0,
        "input_tokens": 0,
        "output_tokens": 0,
    }
    everyone = api.get("/v1/dashboard/batches", headers=admin_headers).json()
    assert everyone["admin"] is True and {mine, theirs} <= {b["id"] for b in everyone["data"]}
    assert {team.project_id, other_team.project_id} <= {t["project_id"] for t in everyone["teams"]}
    assert api.get("/v1/dashboard/batches").status_code == 401


def test_fleet_sample_without_a_readable_fleet(api: CheckedClient, team: Team) -> None:
    sample = api.get("/v1/dashboard/fleet", headers=team.headers).json()
    # The fleet is unreachable in these tests; the lease store (Redis) is not.
    assert sample["object"] == "dashboard.fleet_load" and sample["fleet_inflight"] is None
    assert sample["interactive_inflight"] is None and sample["capacity_control"] is False
    assert sample["limit"] == get_settings().max_inflight and isinstance(sample["batch_inflight"], int)
    assert abs(sample["at"] - time.time()) < 30


@pytest.mark.parametrize("store_kind", ["redis", "sql"])
def test_lease_gauges_read_what_the_lease_store_holds(store_kind: str, api_env: ApiEnv) -> None:
    # Short names: the SQL store keeps the kind in its column.
    pool, namespace = f"p{secrets.token_hex(3)}", "bf-dash-test"
    if store_kind == "redis":
        store: RedisLeaseStore | SqlLeaseStore = RedisLeaseStore(api_env.redis_url, namespace=namespace)
    else:
        store = SqlLeaseStore()
    controlled = Settings(capacity_control=True, capacity_floor=2)

    def gauges() -> tuple[int, int]:
        return dashboard.lease_gauges(controlled, store, pool)

    assert gauges() == (0, 2)  # nothing published: the floor, as admission fails closed
    held = store.acquire(pool, limit=10, n=3, ttl_s=30)
    store.acquire(pool, limit=10, n=2, ttl_s=0.2)  # lapses at once
    store.publish(limit_key(pool), "7", ttl_s=30)
    time.sleep(0.3)
    assert gauges() == (3, 7)
    assert dashboard.lease_gauges(Settings(capacity_control=False, max_inflight=64), store, pool) == (3, 64)
    store.release(pool, held)
    store.withdraw(limit_key(pool))
    assert gauges() == (0, 2)


def test_a_model_pool_without_a_controller_takes_its_deployments_limit(api_env: ApiEnv) -> None:
    store = RedisLeaseStore(api_env.redis_url, namespace=f"bf-dash-{secrets.token_hex(3)}")
    controlled = Settings(capacity_control=True, capacity_floor=1)
    store.publish(limit_key("fleet"), "5", ttl_s=30)
    assert dashboard.lease_gauges(controlled, store, "fleet/m", fallback_pool="fleet") == (0, 5)
    store.publish(limit_key("fleet/m"), "3", ttl_s=30)
    assert dashboard.lease_gauges(controlled, store, "fleet/m", fallback_pool="fleet") == (0, 3)


def test_frontend_metrics_are_found_and_summed() -> None:
    spec = "frontend=http://a:8000/metrics,decode=http://a:9091/metrics;http://b:8000/metrics"
    settings = Settings(fleet_metrics_urls=spec)
    assert dashboard.frontend_metrics_urls(settings) == ["http://a:8000/metrics", "http://b:8000/metrics"]
    text = (
        "# TYPE dynamo_frontend_inflight_requests gauge\n"
        'dynamo_frontend_inflight_requests{model="a"} 3\n'
        'dynamo_frontend_inflight_requests{model="b"} 4\n'
        "# TYPE dynamo_frontend_queued_requests gauge\n"
        'dynamo_frontend_queued_requests{model="a"} 9\n'
    )
    assert dashboard._inflight_of(text) == 7
