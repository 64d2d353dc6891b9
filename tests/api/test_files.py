"""The Files API in-process on real Postgres: the OpenAI shapes, team scoping, the envelope."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from backfill.api.wire import file_id_in
from backfill.jobs.models import File
from backfill.storage.db import unit_of_work
from tests.api.conftest import CheckedClient, Team
from tests.contract.spec import validate

LINE = (
    json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}).encode()
    + b"\n"
)


def upload(
    api: CheckedClient, team: Team, data: bytes = LINE, name: str = "in.jsonl", fields: dict[str, str] | None = None
) -> dict[str, Any]:
    form = {"purpose": "batch", **(fields or {})}
    r = api.post("/v1/files", headers=team.headers, files={"file": (name, data)}, data=form)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_upload_list_retrieve_content_delete(api: CheckedClient, team: Team) -> None:
    f = upload(api, team)
    validate(f, "OpenAIFile")
    assert list(f) == [
        "id", "object", "bytes", "created_at", "expires_at", "filename", "purpose", "status", "status_details",
    ]  # fmt: skip
    assert f["id"].startswith("file-") and f["bytes"] == len(LINE) and f["purpose"] == "batch"
    assert f["status_details"] is None and f["expires_at"] == f["created_at"] + 30 * 24 * 3600

    listed = api.get("/v1/files", headers=team.headers).json()
    validate(listed, "ListFilesResponse")
    assert [x["id"] for x in listed["data"]] == [f["id"]] and listed["first_id"] == listed["last_id"] == f["id"]
    assert api.get(f"/v1/files/{f['id']}", headers=team.headers).json() == f

    content = api.get(f"/v1/files/{f['id']}/content", headers=team.headers)
    assert content.status_code == 200 and content.content == LINE
    assert content.headers["content-type"] == "application/jsonl"
    assert content.headers["content-disposition"].startswith('attachment; filename="in.jsonl"')

    deleted = api.delete(f"/v1/files/{f['id']}", headers=team.headers).json()
    validate(deleted, "DeleteFileResponse")
    assert deleted == {"id": f["id"], "object": "file", "deleted": True}
    gone = api.get(f"/v1/files/{f['id']}", headers=team.headers)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "file_id"
    assert api.get("/v1/files", headers=team.headers).json()["data"] == []


def test_an_empty_list_has_null_cursors(api: CheckedClient, team: Team) -> None:
    listed = api.get("/v1/files", headers=team.headers).json()
    assert listed == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_list_pages_and_orders(api: CheckedClient, team: Team) -> None:
    ids = [upload(api, team, name=f"{i}.jsonl")["id"] for i in range(3)]
    first = api.get("/v1/files", headers=team.headers, params={"limit": 2, "order": "asc"}).json()
    assert [x["id"] for x in first["data"]] == ids[:2] and first["has_more"] is True
    rest = api.get("/v1/files", headers=team.headers, params={"order": "asc", "after": first["last_id"]}).json()
    assert [x["id"] for x in rest["data"]] == ids[2:] and rest["has_more"] is False


def test_expiry_from_the_form(api: CheckedClient, team: Team) -> None:
    f = upload(api, team, fields={"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"})
    assert f["expires_at"] == f["created_at"] + 3600


def test_another_teams_file_is_not_found(api: CheckedClient, team: Team, other_team: Team) -> None:
    f = upload(api, team)
    for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        r = api.request(method, f"/v1/files/{f['id']}{path}", headers=other_team.headers)
        assert r.status_code == 404, (method, path, r.text)
        validate(r.json(), "ErrorResponse")
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert api.get("/v1/files", headers=other_team.headers).json()["data"] == []
    assert api.get(f"/v1/files/{f['id']}", headers=team.headers).status_code == 200  # still there for its owner


def test_upload_errors_use_the_envelope(api: CheckedClient, team: Team) -> None:
    files = {"file": ("a.jsonl", b"{}\n")}
    bad_purpose = api.post("/v1/files", headers=team.headers, files=files, data={"purpose": "nope"})
    assert bad_purpose.status_code == 400 and bad_purpose.json()["error"]["param"] == "purpose"
    validate(bad_purpose.json(), "ErrorResponse")
    no_file = api.post("/v1/files", headers=team.headers, data={"purpose": "batch"})
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
    assert api.get("/v1/files", headers=team.headers).json()["data"] == []  # nothing recorded


def test_an_upload_is_committed_before_its_response_is_sent(api: CheckedClient, team: Team) -> None:
    """A client that got its 200 can use the file at once, from any API process: the row is
    committed before the first byte of the response leaves."""
    app = api.fastapi_app
    committed: list[bool] = []

    async def spy(scope: Scope, receive: Receive, send: Send) -> None:
        async def check(message: Message) -> None:
            if message["type"] == "http.response.body" and scope["path"] == "/v1/files":
                wire_id = json.loads(message["body"])["id"]
                with unit_of_work() as session:  # a connection of its own: sees only committed rows
                    committed.append(session.get(File, file_id_in(wire_id)) is not None)
            await send(message)

        await app(scope, receive, check)

    client = TestClient(spy, base_url="http://backfill.test")  # no `with`: the app's lifespan already ran
    r = client.post("/v1/files", headers=team.headers, files={"file": ("c.jsonl", LINE)}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    assert committed == [True]
