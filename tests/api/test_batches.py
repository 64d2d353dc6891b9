"""The Batches API in-process on real Postgres and Redis: shapes, direct enqueue, team scoping."""

from __future__ import annotations

import base64
import json

import pytest
import redis
from sqlalchemy import update

from backfill.api.wire import batch_id_in
from backfill.jobs.models import Batch, BatchStatus
from backfill.storage.broker import QueueName, TaskName
from backfill.storage.db import unit_of_work
from tests.api.conftest import ApiEnv, CheckedClient, Team
from tests.api.test_files import upload
from tests.contract.spec import validate
from tests.process_env import process_env

BATCH_KEYS = [
    "id", "object", "endpoint", "model", "errors", "input_file_id", "completion_window", "status",
    "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
    "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts", "usage", "metadata",
]  # fmt: skip


def create(api: CheckedClient, team: Team, **extra: object) -> dict[str, object]:
    f = upload(api, team)
    body = {"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    r = api.post("/v1/batches", headers=team.headers, json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _queued_validations(env: ApiEnv) -> list[str]:
    """Batch ids of the validate_batch messages waiting on the validation queue in Redis."""
    client = redis.Redis.from_url(env.redis_url)
    ids = []
    for raw in client.lrange(env.broker_prefix + QueueName.validation.value, 0, -1):
        message = json.loads(raw)
        assert message["headers"]["task"] == TaskName.validate_batch.value
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        ids.append(args[0])
    return ids


def test_create_enqueues_validation_and_reads_back(api: CheckedClient, team: Team, api_env: ApiEnv) -> None:
    b = create(api, team, metadata={"job": "x"})
    validate(b, "Batch")
    assert list(b) == BATCH_KEYS
    assert b["status"] == "validating" and str(b["id"]).startswith("batch_") and b["metadata"] == {"job": "x"}
    assert b["errors"] is None and b["model"] is None and b["cancelled_at"] is None
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert b["usage"] == {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }
    # Sent straight to the validation queue after the commit, with the bare batch id.
    assert batch_id_in(str(b["id"])) in _queued_validations(api_env)

    assert api.get(f"/v1/batches/{b['id']}", headers=team.headers).json() == b
    listed = api.get("/v1/batches", headers=team.headers).json()
    validate(listed, "ListBatchesResponse")
    assert [x["id"] for x in listed["data"]] == [b["id"]] and listed["has_more"] is False


def test_list_pages_newest_first(api: CheckedClient, team: Team) -> None:
    ids = [create(api, team)["id"] for _ in range(3)]
    page = api.get("/v1/batches", headers=team.headers, params={"limit": 2}).json()
    assert [x["id"] for x in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = api.get("/v1/batches", headers=team.headers, params={"after": page["last_id"]}).json()
    assert [x["id"] for x in rest["data"]] == ids[:1] and rest["has_more"] is False


def test_cancel_and_the_409_of_a_finished_batch(api: CheckedClient, team: Team) -> None:
    b = create(api, team)
    cancelled = api.post(f"/v1/batches/{b['id']}/cancel", headers=team.headers).json()
    validate(cancelled, "Batch")
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    assert api.post(f"/v1/batches/{b['id']}/cancel", headers=team.headers).json()["status"] == "cancelling"

    done = create(api, team)
    with unit_of_work() as session:
        session.execute(
            update(Batch).where(Batch.id == batch_id_in(str(done["id"]))).values(status=BatchStatus.completed)
        )
    r = api.post(f"/v1/batches/{done['id']}/cancel", headers=team.headers)
    assert r.status_code == 409, r.text
    validate(r.json(), "ErrorResponse")
    assert r.json()["error"]["code"] == "invalid_state"


def test_failed_validation_errors_read_as_an_error_list(api: CheckedClient, team: Team) -> None:
    b = create(api, team)
    errors = [
        {"code": "invalid_json", "message": "Line 3 is not JSON.", "param": None, "line": 3},
        {"code": "too_many_errors", "message": "2 more errors were not listed.", "param": None, "line": None},
    ]
    with unit_of_work() as session:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id_in(str(b["id"])))
            .values(status=BatchStatus.failed, errors=errors, model="tiny-chat")
        )
    failed = api.get(f"/v1/batches/{b['id']}", headers=team.headers).json()
    validate(failed, "Batch")
    assert failed["status"] == "failed" and failed["model"] == "tiny-chat"
    assert failed["errors"] == {"object": "list", "data": errors}


def test_another_teams_batch_and_file_are_not_found(api: CheckedClient, team: Team, other_team: Team) -> None:
    b = create(api, team)
    for method, path in (("GET", f"/v1/batches/{b['id']}"), ("POST", f"/v1/batches/{b['id']}/cancel")):
        r = api.request(method, path, headers=other_team.headers)
        assert r.status_code == 404, r.text
        validate(r.json(), "ErrorResponse")
        assert r.json()["error"]["param"] == "batch_id"
        assert r.json()["error"]["message"] == f"No batch found with id '{b['id']}'."  # the id the client sent
    r = api.get(f"/v1/files/{b['input_file_id']}", headers=other_team.headers)
    assert r.status_code == 404 and b["input_file_id"] in r.json()["error"]["message"], r.text
    assert api.get("/v1/batches", headers=other_team.headers).json()["data"] == []
    # Nor can another team start a batch on this team's file.
    r = api.post(
        "/v1/batches",
        headers=other_team.headers,
        json={"input_file_id": b["input_file_id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert r.status_code == 404 and r.json()["error"]["param"] in ("input_file_id", "file_id"), r.text
    assert api.get(f"/v1/batches/{b['id']}", headers=team.headers).json()["status"] == "validating"


def test_bad_batch_requests_name_their_param(api: CheckedClient, team: Team) -> None:
    f = upload(api, team)
    good = {"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    for change, param in (
        ({"input_file_id": None}, "input_file_id"),
        ({"endpoint": "/v1/images/generations"}, "endpoint"),
        ({"completion_window": "3d"}, "completion_window"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ):
        body = {k: v for k, v in {**good, **change}.items() if v is not None}
        r = api.post("/v1/batches", headers=team.headers, json=body)
        assert r.status_code == 400, (change, r.text)
        validate(r.json(), "ErrorResponse")
        assert r.json()["error"]["param"] == param
    assert api.get("/v1/batches", headers=team.headers).json()["data"] == []


def test_a_broker_outage_does_not_fail_the_create(
    api: CheckedClient, team: Team, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker only nudges: the batch is committed and answered; the scheduler nudges it later."""
    with process_env({"BACKFILL_BROKER_URL": "redis://127.0.0.1:1/0"}):  # nothing listens on port 1
        b = create(api, team)
        assert b["status"] == "validating"
        assert api.get(f"/v1/batches/{b['id']}", headers=team.headers).status_code == 200
    assert any("could not enqueue validation" in r.getMessage() for r in caplog.records)
