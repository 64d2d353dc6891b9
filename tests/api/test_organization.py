"""The organization API in-process: projects, keys, prices, quotas, usage and costs, each
response held to the app's own OpenAPI document (by the client) and to its wire order here."""

from __future__ import annotations

from datetime import UTC, datetime

from backfill.api.wire import project_id_in
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.jobs.models import Batch, BatchStatus
from backfill.storage.db import unit_of_work
from tests.api.conftest import CheckedClient, Team
from tests.api.test_batches import create


def test_projects_and_keys(api: CheckedClient, team: Team, admin_headers: dict[str, str]) -> None:
    p = api.get(f"/v1/organization/projects/{team.project_id}", headers=admin_headers).json()
    assert list(p) == ["id", "object", "name", "created_at", "archived_at", "status", "weight"]
    assert p["object"] == "organization.project" and p["archived_at"] is None
    assert team.project_id in [
        x["id"] for x in api.get("/v1/organization/projects", headers=admin_headers).json()["data"]
    ]

    created = api.post(f"/v1/organization/projects/{team.project_id}/api_keys", headers=admin_headers, json={}).json()
    assert list(created)[-1] == "value" and created["value"].startswith("sk-")
    keys = api.get(f"/v1/organization/projects/{team.project_id}/api_keys", headers=admin_headers).json()
    assert all("value" not in k for k in keys["data"])  # the raw key is shown once, at creation
    assert list(keys) == ["object", "data", "first_id", "last_id", "has_more"]
    assert keys["first_id"] == keys["data"][0]["id"] and created["id"] in [k["id"] for k in keys["data"]]
    revoked = api.delete(
        f"/v1/organization/projects/{team.project_id}/api_keys/{created['id']}", headers=admin_headers
    ).json()
    assert revoked == {"object": "organization.project.api_key.deleted", "id": created["id"], "deleted": True}
    assert api.get("/v1/files", headers={"Authorization": f"Bearer {created['value']}"}).status_code == 401


def test_prices_and_quotas(api: CheckedClient, team: Team, admin_headers: dict[str, str]) -> None:
    model = f"m-{team.project_id}"
    price = api.post(
        "/v1/organization/prices",
        headers=admin_headers,
        json={"model": model, "input": "1.5", "cached_input": "0.1", "output": 3},
    ).json()
    assert (price["input"], price["output"], price["unit"]) == ("1.500000", "3.000000", "1M tokens")
    prices = api.get("/v1/organization/prices", headers=admin_headers, params={"model": model}).json()
    assert prices["data"] == [price] and prices["first_id"] == prices["last_id"] == price["id"]  # integer ids

    quota = api.post(
        f"/v1/organization/projects/{team.project_id}/quotas",
        headers=admin_headers,
        json={"model": model, "max_concurrent_batches": 2},
    ).json()
    assert quota == {
        "object": "organization.project.quota",
        "project_id": team.project_id,
        "model": model,
        "max_enqueued_tokens": None,
        "max_concurrent_batches": 2,
    }
    quotas = api.get(f"/v1/organization/projects/{team.project_id}/quotas", headers=admin_headers).json()
    assert quotas == {"object": "list", "data": [quota], "first_id": None, "last_id": None, "has_more": False}


def test_usage_and_costs_buckets(api: CheckedClient, team: Team) -> None:
    batch = create(api, team)
    day = datetime(2024, 3, 1, 12, tzinfo=UTC)
    with unit_of_work() as session:
        row = session.get(Batch, str(batch["id"]).removeprefix("batch_"))
        assert row is not None
        row.status = BatchStatus.completed
        session.add(
            UsageLedgerEntry(
                batch_id=row.id,
                line=1,
                team_id=project_id_in(team.project_id),
                model="tiny-chat",
                prompt_tokens=10,
                cached_tokens=4,
                completion_tokens=5,
                input_cost_micros=1,
                cost_micros=1,
                recorded_at=day,
            )
        )
    start = int(datetime(2024, 3, 1, tzinfo=UTC).timestamp())
    usage = api.get(
        "/v1/organization/usage/completions",
        headers=team.headers,
        params={"start_time": start, "end_time": start + 2 * 86400, "group_by": "model"},
    ).json()
    assert list(usage) == ["object", "data", "has_more", "next_page"] and len(usage["data"]) == 2
    first = usage["data"][0]
    assert (first["start_time"], first["end_time"]) == (start, start + 86400)
    assert [(r["input_tokens"], r["input_cached_tokens"], r["model"]) for r in first["results"]] == [
        (10, 4, "tiny-chat")
    ]
    assert usage["data"][1]["results"] == []

    costs = api.get(
        "/v1/organization/costs", headers=team.headers, params={"start_time": start, "end_time": start + 86400}
    )
    assert b'"value":1e-06' in costs.content  # the amount's digits as Python writes them, as always
    assert costs.json()["data"][0]["results"] == [
        {
            "object": "organization.costs.result",
            "amount": {"value": 1e-06, "currency": "usd"},
            "line_item": None,
            "project_id": None,
        }
    ]
