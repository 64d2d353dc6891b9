"""Partial results (`GET /v1/batches/{id}/partial_output`) in-process on Postgres: the finished
lines of a running batch, byte-identical to the lines finalization writes for them."""

from __future__ import annotations

import json

from sqlalchemy import update

from backfill.api.wire import batch_id_in
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcomes
from backfill.jobs.models import Batch, utcnow
from backfill.jobs.output.finalize import finalize_batch
from backfill.jobs.validation.outcome import apply_validation
from backfill.jobs.validation.scan import Limits, validate_lines
from backfill.storage.db import unit_of_work
from backfill.storage.objects import get_object_store
from tests.api.conftest import CheckedClient, Team
from tests.api.test_files import upload

LINES = 5
TOKEN = "partial-test-claim"


def _input() -> bytes:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4},
        }
        for i in range(1, LINES + 1)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _answer(line: int, status: int = 200) -> Outcome:
    body = {"id": f"chatcmpl-{line}", "choices": [{"message": {"content": f"answer {line}"}}]}
    if status >= 400:
        body = {"error": {"message": "bad request", "type": "invalid_request_error"}}
    return Outcome(status_code=status, body=json.dumps(body).encode(), request_id=f"r-{line}", usage=Usage(3, 0, 2))


def _validated_batch(api: CheckedClient, team: Team) -> tuple[str, str]:
    """A batch validated in-process, its lines pending: (wire id, id)."""
    data = _input()
    f = upload(api, team, data=data)
    r = api.post(
        "/v1/batches",
        headers=team.headers,
        json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    wire_id = r.json()["id"]
    batch_id = batch_id_in(wire_id)
    result = validate_lines(
        [data], endpoint="/v1/chat/completions", served_models=None, limits=Limits(100, 1 << 20, 10)
    )
    with unit_of_work() as session:
        assert apply_validation(session, batch_id=batch_id, result=result) == "in_progress"
    return wire_id, batch_id


def _running_batch(api: CheckedClient, team: Team) -> tuple[str, str]:
    """A batch validated in-process, every line claimed by TOKEN: (wire id, id)."""
    wire_id, batch_id = _validated_batch(api, team)
    with unit_of_work() as session:
        assert len(claim_requests(session, batch_id=batch_id, limit=LINES, claim_token=TOKEN)) == LINES
    return wire_id, batch_id


def _record(batch_id: str, *results: tuple[int, Outcome]) -> None:
    with unit_of_work() as session:
        assert record_outcomes(session, claim_token=TOKEN, results=[(batch_id, n, o) for n, o in results]) == len(
            results
        )


def test_finished_lines_of_a_running_batch_match_the_final_files(api: CheckedClient, team: Team) -> None:
    wire_id, batch_id = _running_batch(api, team)
    path = f"/v1/batches/{wire_id}/partial_output"
    assert api.get(path, headers=team.headers).content == b""  # nothing finished yet

    _record(batch_id, (3, _answer(3)), (1, _answer(1)), (2, _answer(2, status=400)))
    partial = api.get(path, headers=team.headers)
    assert partial.status_code == 200 and partial.headers["content-type"].startswith("application/jsonl")
    assert [json.loads(x)["custom_id"] for x in partial.content.splitlines()] == ["req-1", "req-3"]  # input order
    errors = api.get(path, headers=team.headers, params={"kind": "errors"}).content
    assert [json.loads(x)["custom_id"] for x in errors.splitlines()] == ["req-2"]
    assert api.get(f"/v1/batches/{wire_id}", headers=team.headers).json()["status"] == "in_progress"

    _record(batch_id, (4, _answer(4)), (5, _answer(5)))
    assert finalize_batch(unit_of_work, get_object_store(), batch_id=batch_id) == "completed"
    final = api.get(f"/v1/batches/{wire_id}", headers=team.headers).json()
    output = api.get(f"/v1/files/{final['output_file_id']}/content", headers=team.headers).content
    error_file = api.get(f"/v1/files/{final['error_file_id']}/content", headers=team.headers).content

    # The lines served while running are the very bytes the output file holds for them.
    final_lines = {json.loads(x)["custom_id"]: x for x in output.splitlines()}
    assert partial.content.splitlines() == [final_lines["req-1"], final_lines["req-3"]]
    assert errors == error_file
    # Once finished, the partial output is the whole output.
    assert api.get(path, headers=team.headers).content == output


def test_scoping_kinds_and_purged_bodies(api: CheckedClient, team: Team, other_team: Team) -> None:
    wire_id, batch_id = _running_batch(api, team)
    path = f"/v1/batches/{wire_id}/partial_output"
    assert api.get(path, headers=other_team.headers).status_code == 404
    assert api.get("/v1/batches/batch_nope/partial_output", headers=team.headers).status_code == 404
    bad = api.get(path, headers=team.headers, params={"kind": "everything"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kind"

    with unit_of_work() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(bodies_purged_at=utcnow()))
    purged = api.get(path, headers=team.headers)
    assert purged.status_code == 409 and "output and error files" in purged.json()["error"]["message"]


def test_lines_still_pending_are_no_errors_while_the_batch_runs(api: CheckedClient, team: Team) -> None:
    """A pending line of a running batch has not finished: `kind=errors` lists only what failed
    (it used to list every pending line as `batch_expired`). Once the batch is cancelled, its
    pending lines are the error file's `batch_cancelled` lines."""
    wire_id, batch_id = _validated_batch(api, team)
    with unit_of_work() as session:
        (claimed,) = claim_requests(session, batch_id=batch_id, limit=1, claim_token=TOKEN)
    _record(batch_id, (claimed.line, _answer(claimed.line, status=400)))
    path = f"/v1/batches/{wire_id}/partial_output"
    errors = api.get(path, headers=team.headers, params={"kind": "errors"}).content.splitlines()
    assert [json.loads(x)["custom_id"] for x in errors] == [claimed.custom_id]

    assert api.post(f"/v1/batches/{wire_id}/cancel", headers=team.headers).status_code == 200
    errors = api.get(path, headers=team.headers, params={"kind": "errors"}).content.splitlines()
    assert len(errors) == LINES
    codes = [(json.loads(x)["error"] or {}).get("code") for x in errors]  # (a fleet 4xx is a response)
    assert codes.count("batch_cancelled") == LINES - 1
