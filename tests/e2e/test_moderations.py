"""/v1/moderations batches, through the OpenAI SDK against the real stack: accepted as OpenAI
accepts them (`input`, an optional `model`), passed to the fleet, and each line answered with
what the fleet answers. The Dynamo mocker serves no moderations, so each line carries the
fleet's own error reply, in the error file, as OpenAI reports a line's error."""

from __future__ import annotations

import httpx
import pytest

from backfill.devfleet.fleet import Fleet
from tests.contract.spec import validate
from tests.e2e.helpers import MODEL, jsonl, read_lines, upload, wait_for

pytestmark = pytest.mark.e2e

MODERATIONS = "/v1/moderations"


def test_a_moderations_batch_completes_with_each_line_carrying_the_fleets_reply(client, fleet: Fleet) -> None:
    lines = [
        {"custom_id": "plain", "method": "POST", "url": MODERATIONS, "body": {"input": "is this fine?"}},
        {"custom_id": "many", "method": "POST", "url": MODERATIONS, "body": {"input": ["one", "two"]}},
        {"custom_id": "named", "method": "POST", "url": MODERATIONS, "body": {"input": "x", "model": MODEL}},
    ]
    f = upload(client, jsonl(lines))
    batch = client.batches.create(input_file_id=f.id, endpoint=MODERATIONS, completion_window="24h")
    validate(batch.model_dump(), "Batch")
    assert batch.endpoint == MODERATIONS
    done = wait_for(client, batch.id, {"completed", "failed", "expired", "cancelled"})
    assert done.status == "completed", done.errors
    validate(done.model_dump(), "Batch")
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 0, 3)
    assert done.output_file_id is None

    # What the fleet itself answers a moderation request.
    direct = httpx.post(f"{fleet.base_url}/moderations", json={"input": "is this fine?"}, timeout=30)
    assert direct.status_code >= 400, "the mocker serves moderations now: this test wants a real reply"
    fleet_error = direct.json()
    fleet_error = fleet_error.get("error", fleet_error)
    assert "moderations" in fleet_error["message"]
    errors = {e["custom_id"]: e for e in read_lines(client, done.error_file_id)}
    assert sorted(errors) == ["many", "named", "plain"]
    for e in errors.values():
        assert e["error"] is None
        assert e["response"]["status_code"] == direct.status_code
        # The fleet's own error, in OpenAI's envelope (the mocker's is a bare error object).
        error = e["response"]["body"]["error"]
        assert {key: error[key] for key in fleet_error} == fleet_error
