"""OpenAI's `group_by=api_key_id` on the usage API: one result per key, as `key_...` ids."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from backfill.api.wire import project_id_in
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.jobs.models import Batch, BatchStatus
from backfill.storage.db import unit_of_work
from tests.api.conftest import CheckedClient, Team
from tests.api.test_batches import create


def test_usage_grouped_and_filtered_by_api_key(api: CheckedClient, team: Team, admin_headers: dict[str, str]) -> None:
    keys = api.get(f"/v1/organization/projects/{team.project_id}/api_keys", headers=admin_headers).json()["data"]
    made = api.post(
        f"/v1/organization/projects/{team.project_id}/api_keys", headers=admin_headers, json={"name": "second"}
    ).json()
    first_id, second_id = keys[0]["id"], made["id"]
    assert first_id.startswith("key_") and second_id.startswith("key_")

    batch = create(api, team)
    day = datetime(2024, 5, 1, 12, tzinfo=UTC)
    with unit_of_work() as session:
        row = session.get(Batch, str(batch["id"]).removeprefix("batch_"))
        assert row is not None
        row.status = BatchStatus.completed
        for line, (key_id, tokens) in enumerate([(first_id, 10), (first_id, 20), (second_id, 300), (None, 7)]):
            session.add(
                UsageLedgerEntry(
                    batch_id=row.id,
                    line=line,
                    team_id=project_id_in(team.project_id),
                    api_key_id=key_id.removeprefix("key_") if key_id else None,  # None: from before keys were recorded
                    model="tiny-chat",
                    prompt_tokens=tokens,
                    completion_tokens=1,
                    recorded_at=day,
                )
            )
    start = int(datetime(2024, 5, 1, tzinfo=UTC).timestamp())
    window = {"start_time": start, "end_time": start + 86400}

    grouped = api.get(
        "/v1/organization/usage/completions", headers=team.headers, params={**window, "group_by": "api_key_id"}
    ).json()
    (bucket,) = grouped["data"]
    by_key = {r["api_key_id"]: (r["input_tokens"], r["num_model_requests"]) for r in bucket["results"]}
    assert by_key == {first_id: (30, 2), second_id: (300, 1), None: (7, 1)}
    assert all(r["project_id"] is None and r["model"] is None for r in bucket["results"])

    both = api.get(
        "/v1/organization/usage/completions",
        headers=team.headers,
        params={**window, "group_by": ["api_key_id", "model"], "api_key_ids": second_id},
    ).json()
    assert [(r["api_key_id"], r["model"], r["input_tokens"]) for r in both["data"][0]["results"]] == [
        (second_id, "tiny-chat", 300)
    ]

    unknown = api.get(
        "/v1/organization/usage/completions",
        headers=team.headers,
        params={**window, "api_key_ids": "key_" + secrets.token_hex(6)},
    ).json()
    assert unknown["data"][0]["results"] == []
