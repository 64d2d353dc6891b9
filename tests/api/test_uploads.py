"""The Uploads API in-process on real Postgres (a local object directory): OpenAI's shapes (the
official SDK's types), the file it makes, team scoping and every refusal in the one envelope."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from openai.types import Upload as SdkUpload
from openai.types.uploads import UploadPart as SdkUploadPart
from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from backfill.api.wire import file_id_out, upload_id_in
from backfill.jobs.models import File, Upload, UploadPart, utcnow
from backfill.jobs.retention import RetentionPolicy, run_retention
from backfill.storage.db import unit_of_work
from backfill.storage.objects import get_object_store
from tests.api.conftest import CheckedClient, Team

LINE = (
    json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}).encode()
    + b"\n"
)


def create(api: CheckedClient, team: Team, size: int, **extra: Any) -> dict[str, Any]:
    body = {"bytes": size, "filename": "in.jsonl", "mime_type": "text/jsonl", "purpose": "batch", **extra}
    r = api.post("/v1/uploads", headers=team.headers, json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def add_part(api: CheckedClient, team: Team, upload_id: str, data: bytes) -> Any:
    return api.post(f"/v1/uploads/{upload_id}/parts", headers=team.headers, files={"data": ("blob", data)})


def part(api: CheckedClient, team: Team, upload_id: str, data: bytes) -> str:
    r = add_part(api, team, upload_id, data)
    assert r.status_code == 200, r.text
    SdkUploadPart.model_validate(r.json())
    assert list(r.json()) == ["id", "object", "created_at", "upload_id"] and r.json()["upload_id"] == upload_id
    return r.json()["id"]  # type: ignore[no-any-return]


def complete(api: CheckedClient, team: Team, upload_id: str, part_ids: list[str], md5: str | None = None) -> Any:
    body: dict[str, Any] = {"part_ids": part_ids} | ({"md5": md5} if md5 else {})
    return api.post(f"/v1/uploads/{upload_id}/complete", headers=team.headers, json=body)


def error(r: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err  # type: ignore[no-any-return]


def content(api: CheckedClient, team: Team, file_id: str) -> bytes:
    r = api.get(f"/v1/files/{file_id}/content", headers=team.headers)
    assert r.status_code == 200, r.text
    return r.content


def test_parts_make_a_file_in_the_order_named(api: CheckedClient, team: Team) -> None:
    pieces = [LINE * 3, LINE, LINE * 2]
    data = b"".join(pieces)
    up = create(api, team, len(data))
    SdkUpload.model_validate(up)
    assert up["object"] == "upload" and up["status"] == "pending" and up["file"] is None
    assert up["id"].startswith("upload_") and up["expires_at"] == up["created_at"] + 3600
    assert (up["bytes"], up["filename"], up["purpose"]) == (len(data), "in.jsonl", "batch")

    ids = [part(api, team, up["id"], p) for p in pieces]
    done = complete(api, team, up["id"], ids, md5=hashlib.md5(data).hexdigest())
    assert done.status_code == 200, done.text
    SdkUpload.model_validate(done.json())
    out = done.json()
    assert out["status"] == "completed" and out["id"] == up["id"]
    f = out["file"]
    assert f["object"] == "file" and f["bytes"] == len(data) and f["purpose"] == "batch" and f["filename"] == "in.jsonl"
    assert content(api, team, f["id"]) == data
    assert api.get(f"/v1/files/{f['id']}", headers=team.headers).json() == f
    with unit_of_work() as session:  # the parts are gone once the file is made
        assert session.execute(select(UploadPart).where(UploadPart.upload_id == upload_id_in(up["id"]))).first() is None


def test_parts_named_out_of_order_and_unnamed_parts(api: CheckedClient, team: Team) -> None:
    a, b, c = b"A" * 10, b"B" * 20, b"C" * 5
    up = create(api, team, 25)
    ids = [part(api, team, up["id"], x) for x in (a, c)]
    error(complete(api, team, up["id"], ids), 400, "upload_size_mismatch")  # 15 bytes, not 25
    error(add_part(api, team, up["id"], b), 413, "upload_size_exceeded")  # 15 + 20 > 25 received
    up = create(api, team, 30)
    ia, ib = part(api, team, up["id"], a), part(api, team, up["id"], b)
    done = complete(api, team, up["id"], [ib, ia])  # the server-side concatenation: b, then a
    assert done.status_code == 200, done.text
    assert content(api, team, done.json()["file"]["id"]) == b + a


def test_a_completed_upload_is_a_batch_input(api: CheckedClient, team: Team) -> None:
    up = create(api, team, len(LINE))
    done = complete(api, team, up["id"], [part(api, team, up["id"], LINE)]).json()
    batch = api.post(
        "/v1/batches",
        headers=team.headers,
        json={"input_file_id": done["file"]["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert batch.status_code == 200, batch.text
    assert batch.json()["input_file_id"] == done["file"]["id"] and batch.json()["status"] == "validating"


def test_refusals(api: CheckedClient, team: Team, other_team: Team) -> None:
    error(api.post("/v1/uploads", headers=team.headers, json={"bytes": 9 * 1024**3, "filename": "x.jsonl",
          "mime_type": "text/jsonl", "purpose": "batch"}), 413, "upload_too_large")  # fmt: skip
    err = error(api.post("/v1/uploads", headers=team.headers, json={"bytes": 5, "filename": "x.jsonl",
                "mime_type": "text/jsonl", "purpose": "nope"}), 400)  # fmt: skip
    assert err["param"] == "purpose"

    up = create(api, team, len(LINE))
    # Unknown and foreign ids: 404, exactly alike, and never another team's data.
    for r in (
        add_part(api, other_team, up["id"], LINE),
        complete(api, other_team, up["id"], []),
        api.post(f"/v1/uploads/{up['id']}/cancel", headers=other_team.headers),
        add_part(api, team, "upload_nope", LINE),
        add_part(api, team, "nope", LINE),
    ):
        assert error(r, 404, "not_found")["param"] == "upload_id"
    foreign = create(api, other_team, len(LINE))
    foreign_part = part(api, other_team, foreign["id"], LINE)
    for ids in (["part_nope"], ["nope"], [foreign_part]):
        assert error(complete(api, team, up["id"], ids), 404, "not_found")["param"] == "part_ids"
    error(add_part(api, team, up["id"], b""), 400, "empty_part")

    mine = part(api, team, up["id"], LINE)
    error(complete(api, team, up["id"], [mine, mine]), 400, "duplicate_part")
    error(complete(api, team, up["id"], [mine], md5="0" * 32), 400, "md5_mismatch")
    # The mismatch cancelled the upload: nothing more goes in.
    error(add_part(api, team, up["id"], LINE), 409, "upload_cancelled")
    error(complete(api, team, up["id"], [mine]), 409, "upload_cancelled")

    up = create(api, team, len(LINE))
    done = complete(api, team, up["id"], [part(api, team, up["id"], LINE)])
    assert done.status_code == 200
    error(add_part(api, team, up["id"], LINE), 409, "upload_completed")
    error(api.post(f"/v1/uploads/{up['id']}/cancel", headers=team.headers), 409, "upload_completed")

    up = create(api, team, len(LINE))
    cancelled = api.post(f"/v1/uploads/{up['id']}/cancel", headers=team.headers)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    SdkUpload.model_validate(cancelled.json())
    error(add_part(api, team, up["id"], LINE), 409, "upload_cancelled")


def test_a_part_over_64_mib_is_refused_at_its_cap(api: CheckedClient, team: Team) -> None:
    up = create(api, team, 100 * 1024 * 1024)
    err = error(add_part(api, team, up["id"], b"x" * (64 * 1024 * 1024 + 1)), 413, "part_too_large")
    assert err["param"] == "data"


def _expire(upload_id: str) -> None:
    with unit_of_work() as session:
        session.execute(
            update(Upload)
            .where(Upload.id == upload_id_in(upload_id))
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )


def test_an_expired_upload_takes_nothing_and_retention_removes_its_parts(
    api: CheckedClient, team: Team, tmp_path: Any
) -> None:
    up = create(api, team, 2 * len(LINE))
    ids = [part(api, team, up["id"], LINE)]
    _expire(up["id"])
    error(add_part(api, team, up["id"], LINE), 409, "upload_expired")
    error(complete(api, team, up["id"], ids), 409, "upload_expired")
    error(api.post(f"/v1/uploads/{up['id']}/cancel", headers=team.headers), 409, "upload_expired")

    store = get_object_store()
    with unit_of_work() as session:
        row = session.get(Upload, upload_id_in(up["id"]))
        assert row is not None
        multipart = store.root / ".multipart" / row.multipart_id  # type: ignore[attr-defined]
    assert any(multipart.iterdir())
    report = run_retention(unit_of_work, store, policy=RetentionPolicy(result_body_grace_s=-1))
    assert report.uploads >= 1
    assert not multipart.exists()
    with unit_of_work() as session:
        row = session.get(Upload, upload_id_in(up["id"]))
        assert row is not None and row.status == "expired" and row.cleaned_at is not None
        assert session.execute(select(UploadPart).where(UploadPart.upload_id == row.id)).first() is None


@pytest.mark.parametrize("path", ["/v1/uploads/upload_x/parts", "/v1/uploads/upload_x/complete"])
def test_parts_and_completions_take_upload_slots(path: str) -> None:
    from backfill.api.limits import is_upload

    assert is_upload({"type": "http", "method": "POST", "path": path})
    assert not is_upload({"type": "http", "method": "POST", "path": "/v1/uploads"})


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [("Upload", SdkUpload), ("UploadPart", SdkUploadPart)],
)
def test_the_wire_models_are_the_sdks(api: CheckedClient, ours: str, theirs: Any) -> None:
    """OpenAI's published batch spec has no Uploads: the app's own document is held to the
    official SDK's types instead (the same properties, required set and enums)."""
    schema = api.fastapi_app.openapi()["components"]["schemas"][ours]
    sdk = theirs.model_json_schema()
    assert set(schema["properties"]) == set(sdk["properties"])
    assert set(schema["required"]) == set(sdk["required"])
    for name, prop in sdk["properties"].items():
        for key in ("enum", "const"):
            if key in prop:
                assert schema["properties"][name].get(key) == prop[key], name


def test_a_completion_whose_record_failed_is_retried_to_the_same_file(
    api: CheckedClient, team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store made the file, then the transaction recording it failed: the retry answers 200
    with the file the first attempt made (its id fixed when the upload was claimed), and so does
    the retry after that."""
    from backfill.api.routes import uploads as routes

    calls = 0

    @contextmanager
    def record_fails_once() -> Iterator[Session]:
        nonlocal calls
        calls += 1
        with unit_of_work() as session:
            yield session
            if calls == 2:  # the claim, then the record
                raise OperationalError("COMMIT", {}, Exception("the database went away"))

    pieces = [LINE * 2, LINE]
    data = b"".join(pieces)
    up = create(api, team, len(data))
    ids = [part(api, team, up["id"], p) for p in pieces]
    with monkeypatch.context() as patch:
        patch.setattr(routes, "unit_of_work", record_fails_once)
        assert complete(api, team, up["id"], ids).status_code == 503  # the database was away: retry
    with unit_of_work() as session:
        row = session.get(Upload, upload_id_in(up["id"]))
        assert row is not None
        claimed_file = row.file_id
    done = complete(api, team, up["id"], ids)
    assert done.status_code == 200, done.text
    f = done.json()["file"]
    assert f["id"] == file_id_out(claimed_file) and content(api, team, f["id"]) == data
    again = complete(api, team, up["id"], ids)
    assert again.status_code == 200, again.text
    assert again.json()["file"] == f and again.json()["status"] == "completed"
    with unit_of_work() as session:
        assert session.execute(select(func.count()).select_from(File).where(File.id == claimed_file)).scalar() == 1
