"""`POST /v1/files` against hostile clients, over real HTTP: a uvicorn server in a thread serving
`create_app()` on the real Postgres and a local-directory object store. Bodies are written by
hand on raw sockets so a test can stall, cut short or flood them."""

from __future__ import annotations

import json
import secrets
import select
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import func
from sqlalchemy import select as sql_select
from starlette.types import ASGIApp

from backfill.api.app import create_app
from backfill.api.limits import UPLOAD_OVERHEAD_BYTES, UploadGate
from backfill.api.ratelimit import RateLimit
from backfill.jobs.files import MAX_FILENAME_CHARS
from backfill.jobs.models import File
from backfill.jobs.teams import create_key, get_or_create_team
from backfill.storage.db import unit_of_work
from backfill.storage.process_state import reset as reset_process_state

MAX_FILE_BYTES = 1024 * 1024
BOUNDARY = b"backfill-test-7MA4YWxkTrZu0gW"
CONTENT_TYPE = "multipart/form-data; boundary=" + BOUNDARY.decode()
LINE = b'{"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


# ---- the service, in this process ------------------------------------------------------------


def reset_process_caches() -> None:
    """Settings, engine and object store are built once per process; the tests change the
    environment between servers, so drop them (closing the engine's connections)."""
    import backfill.storage.db
    import backfill.storage.objects
    import backfill.storage.settings

    if backfill.storage.db.get_engine.cache_info().currsize:
        backfill.storage.db.get_engine().dispose()
    reset_process_state()


@dataclass
class Service:
    home: Path
    s3: Any = None  # a boto3 client when the object store is S3
    bucket: str = ""

    def stored_objects(self) -> list[str]:
        """Every object the store holds (the local store's `.tmp-` files too)."""
        if self.s3 is not None:
            listing = self.s3.list_objects_v2(Bucket=self.bucket)
            return sorted(str(o["Key"]) for o in listing.get("Contents", []))
        root = self.home / "objects"
        return sorted(str(p) for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.fixture
def service(scratch_pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Service]:
    home = tmp_path / "home"
    # The configured keys stay as they are: an app started with one unset revokes the key it
    # had configured in this shared scratch database, which the package's other tests use.
    for name in ("BACKFILL_S3_ENDPOINT_URL", "BACKFILL_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BACKFILL_ENVIRONMENT", "development")
    monkeypatch.setenv("BACKFILL_DATABASE_URL", scratch_pg_url)
    monkeypatch.setenv("BACKFILL_HOME", str(home))
    monkeypatch.setenv("BACKFILL_MAX_FILE_BYTES", str(MAX_FILE_BYTES))
    monkeypatch.setenv("BACKFILL_RATE_LIMIT", "off")
    reset_process_caches()
    yield Service(home=home)
    reset_process_caches()


@pytest.fixture
def s3_service(service: Service, s3: Any, monkeypatch: pytest.MonkeyPatch) -> Service:
    """`service` with the object store on the SeaweedFS S3 server, in a bucket of its own."""
    bucket = "uploads-" + secrets.token_hex(4)
    s3.create_bucket(bucket)
    monkeypatch.setenv("BACKFILL_S3_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("BACKFILL_S3_BUCKET", bucket)
    monkeypatch.setenv("BACKFILL_S3_ACCESS_KEY", s3.access_key)
    monkeypatch.setenv("BACKFILL_S3_SECRET_KEY", s3.secret_key)
    reset_process_caches()
    return Service(home=service.home, s3=s3.client(), bucket=bucket)


def api_key() -> tuple[str, str]:
    """A new team and its key: (team id, raw key)."""
    with unit_of_work() as session:
        team = get_or_create_team(session, name="t-" + secrets.token_hex(6))
        _, raw = create_key(session, team_id=team.id)
        return team.id, raw


def file_rows(team_id: str) -> int:
    with unit_of_work() as session:
        return int(session.execute(sql_select(func.count()).where(File.team_id == team_id)).scalar_one())


def build_app() -> ASGIApp:
    """`create_app()` with the upload gate and the rate limit outside it, unless it already
    installs them itself."""
    app = create_app()
    installed: set[object] = {m.cls for m in app.user_middleware}
    asgi: ASGIApp = app
    if UploadGate not in installed:
        asgi = UploadGate(asgi)
    if RateLimit not in installed:
        asgi = RateLimit(asgi)
    return asgi


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(app: ASGIApp) -> Iterator[int]:
    """Serve `app` with uvicorn in a thread; yields its port."""
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=3)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=15)


# ---- bodies written by hand ------------------------------------------------------------------


def part(name: str, value: bytes) -> bytes:
    return b"--" + BOUNDARY + f'\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + value + b"\r\n"


def file_head(filename: bytes = b"input.jsonl", extra_header: bytes = b"") -> bytes:
    return (
        b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n'
        b"Content-Type: application/jsonl\r\n" + extra_header + b"\r\n"
    )


def file_part(content: bytes, filename: bytes = b"input.jsonl") -> bytes:
    return file_head(filename) + content + b"\r\n"


CLOSING = b"--" + BOUNDARY + b"--\r\n"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def error(self) -> dict[str, Any]:
        envelope = json.loads(self.body)
        assert set(envelope) == {"error"} and set(envelope["error"]) == {"message", "type", "param", "code"}
        return dict(envelope["error"])


class RawRequest:
    """One `POST` written by hand on a socket: chunked unless a Content-Length is given."""

    def __init__(self, port: int, *, key: str, content_length: int | None = None, path: str = "/v1/files") -> None:
        self.chunked = content_length is None
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        head = [
            f"POST {path} HTTP/1.1",
            "Host: 127.0.0.1",
            f"Authorization: Bearer {key}",
            f"Content-Type: {CONTENT_TYPE}",
        ]
        head.append("Transfer-Encoding: chunked" if self.chunked else f"Content-Length: {content_length}")
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        self.sent = 0

    def send(self, data: bytes) -> None:
        self.sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n" if self.chunked else data)
        self.sent += len(data)

    def end(self) -> None:
        if self.chunked:
            self.sock.sendall(b"0\r\n\r\n")

    def answered(self, wait_s: float = 0.0) -> bool:
        return bool(select.select([self.sock], [], [], wait_s)[0])

    def pour(self, pieces: Iterable[bytes], *, pause_s: float = 0.001) -> bool:
        """Send pieces until the server answers; True if it answered before they ran out."""
        for piece in pieces:
            if self.answered():
                return True
            try:
                self.send(piece)
            except OSError:  # the server answered and closed while we were still writing
                return True
            time.sleep(pause_s)
        return self.answered(5.0)

    def reply(self, timeout_s: float = 15.0) -> Reply:
        self.sock.settimeout(timeout_s)
        data = b""
        with suppress(ConnectionResetError):
            while b"\r\n\r\n" not in data:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            length = int(headers.get("content-length", "0"))
            while len(body) < length:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                body += chunk
            return Reply(status=int(lines[0].split()[1]), headers=headers, body=body[:length])
        raise AssertionError(f"connection reset before a full reply: {data!r}")

    def close(self) -> None:
        self.sock.close()


def post_body(port: int, key: str, body: bytes) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/files",
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": CONTENT_TYPE},
        timeout=30,
    )


def valid_body(content: bytes = LINE * 10, *, filename: bytes = b"input.jsonl", file_first: bool = False) -> bytes:
    fields = part("purpose", b"batch")
    return (file_part(content, filename) + fields if file_first else fields + file_part(content, filename)) + CLOSING


# ---- uploads never starve other routes -------------------------------------------------------


def test_stalled_uploads_leave_other_routes_answering(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    # More stalled uploads than anyio's shared pool has threads (40), all admitted by the gate:
    # each holds an upload thread, none of the pool the key check and the sync routes run in.
    monkeypatch.setenv("BACKFILL_MAX_CONCURRENT_UPLOADS", "64")
    monkeypatch.setenv("BACKFILL_MAX_CONCURRENT_UPLOADS_PER_KEY", "64")
    _, key = api_key()
    with serve(build_app()) as port:
        stalled = [RawRequest(port, key=key) for _ in range(45)]
        try:
            for upload in stalled:
                upload.send(part("purpose", b"batch") + file_head() + LINE * 100)
            time.sleep(2.0)  # every upload is past its key check, its file streaming into the store
            assert not any(upload.answered() for upload in stalled)
            started = time.monotonic()
            listed = httpx.get(
                f"http://127.0.0.1:{port}/v1/files", headers={"Authorization": f"Bearer {key}"}, timeout=10
            )
            assert listed.status_code == 200, listed.text
            assert time.monotonic() - started < 3.0
        finally:
            for upload in stalled:
                upload.close()
    # Cut off mid-file, none of them left an object behind.
    time.sleep(0.5)
    assert service.stored_objects() == []


def test_uploads_past_the_bound_get_429_with_retry_after(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_MAX_CONCURRENT_UPLOADS", "3")
    monkeypatch.setenv("BACKFILL_MAX_CONCURRENT_UPLOADS_PER_KEY", "2")
    _, key_a = api_key()
    _, key_b = api_key()
    _, key_c = api_key()
    with serve(build_app()) as port:
        held = []
        try:
            for key in (key_a, key_a):
                upload = RawRequest(port, key=key)
                upload.send(part("purpose", b"batch") + file_head() + LINE)
                held.append(upload)
            time.sleep(0.3)
            # A third upload for key A: over its own bound.
            refused = post_body(port, key_a, valid_body())
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
            assert "for this API key" in error["message"]
            # Key B takes the last slot; key C finds the server full.
            upload = RawRequest(port, key=key_b)
            upload.send(part("purpose", b"batch") + file_head() + LINE)
            held.append(upload)
            time.sleep(0.3)
            full = post_body(port, key_c, valid_body())
            assert full.status_code == 429 and "on this server" in full.json()["error"]["message"]
            # A finished upload gives its slot back.
            held[0].send(LINE + b"\r\n" + CLOSING)
            held[0].end()
            assert held[0].reply().status == 200
            assert post_body(port, key_c, valid_body()).status_code == 200
        finally:
            for upload in held:
                upload.close()


# ---- every size limit holds with or without Content-Length -----------------------------------


def _fields(n: int, size: int) -> Iterator[bytes]:
    for i in range(n):
        yield part(f"extra{i}", b"v" * size)


def test_chunked_flood_of_small_fields_is_cut_off_early(service: Service) -> None:
    _, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key)
        assert upload.pour(_fields(4000, 1000)), "the server read 4 MB of form fields without answering"
        reply = upload.reply()
        upload.close()
    assert reply.status == 400
    assert reply.error["code"] == "too_many_fields"
    assert upload.sent < 512 * 1024


def test_chunked_giant_field_is_cut_off_early(service: Service) -> None:
    _, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key)
        upload.send(b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n')
        assert upload.pour(b"x" * 16384 for _ in range(256)), "the server read 4 MB of one field"
        reply = upload.reply()
        upload.close()
    assert (reply.status, reply.error["code"], reply.error["param"]) == (400, "fields_too_large", "purpose")
    assert upload.sent < 512 * 1024


def test_chunked_giant_part_header_is_cut_off_early(service: Service) -> None:
    _, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key)
        upload.send(b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="purpose"\r\n')
        # Headers each under python-multipart's own per-header cap, together over the part's.
        headers = (f"X-Pad-{i}: ".encode() + b"y" * 3000 + b"\r\n" for i in range(1000))
        assert upload.pour(headers), "the server read 3 MB of part headers"
        reply = upload.reply()
        upload.close()
    assert (reply.status, reply.error["code"]) == (400, "header_too_large")
    assert upload.sent < 512 * 1024


def test_chunked_file_over_the_cap_is_refused_and_not_stored(service: Service) -> None:
    team, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key)
        upload.send(part("purpose", b"batch") + file_head())
        assert upload.pour(LINE * 200 for _ in range(400)), "the server read 6 MB past a 1 MB cap"
        reply = upload.reply()
        upload.close()
    assert (reply.status, reply.error["code"]) == (413, "file_too_large")
    assert upload.sent < 3 * MAX_FILE_BYTES
    assert service.stored_objects() == [] and file_rows(team) == 0


def test_chunked_bytes_after_the_form_count_against_the_cap(service: Service) -> None:
    # A complete, valid form followed by an endless epilogue: the body as a whole is capped.
    team, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key)
        upload.send(valid_body())
        assert upload.pour(b"z" * 65536 for _ in range(100)), "the server read 6 MB of epilogue"
        reply = upload.reply()
        upload.close()
    assert reply.status == 413
    assert upload.sent < MAX_FILE_BYTES + UPLOAD_OVERHEAD_BYTES + 1024 * 1024
    assert service.stored_objects() == [] and file_rows(team) == 0


def test_declared_length_over_the_cap_is_refused_before_the_body(service: Service) -> None:
    _, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key, content_length=MAX_FILE_BYTES + UPLOAD_OVERHEAD_BYTES + 1)
        assert upload.answered(5.0)
        reply = upload.reply()
        upload.close()
    assert (reply.status, reply.error["code"]) == (413, "file_too_large")


# ---- names and fields are checked before anything is stored ----------------------------------


def test_overlong_filename_is_a_400_and_nothing_is_stored(service: Service) -> None:
    team, key = api_key()
    with serve(build_app()) as port:
        response = post_body(port, key, valid_body(filename=b"a" * (MAX_FILENAME_CHARS + 88)))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "file", "invalid_filename")
        # The longest name the column holds is fine.
        longest = "é" * MAX_FILENAME_CHARS
        ok = post_body(port, key, valid_body(filename=longest.encode()))
        assert ok.status_code == 200, ok.text
        assert ok.json()["filename"] == longest
    assert len(service.stored_objects()) == 1 and file_rows(team) == 1


@pytest.mark.parametrize("filename", [b"in\x00put.jsonl", b"in\x1bput.jsonl", b"in\x7fput.jsonl", b"\xff\xfe.jsonl"])
def test_control_characters_or_bad_utf8_in_filename_are_a_400(service: Service, filename: bytes) -> None:
    team, key = api_key()
    with serve(build_app()) as port:
        response = post_body(port, key, valid_body(filename=filename))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "file"
    assert service.stored_objects() == [] and file_rows(team) == 0


def test_bad_filename_is_refused_before_the_file_is_read(service: Service) -> None:
    _, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key)
        upload.send(part("purpose", b"batch") + file_head(b"n" * 2000) + LINE)
        assert upload.answered(5.0), "the name was only checked after the whole body"
        reply = upload.reply()
        upload.close()
    assert (reply.status, reply.error["code"]) == (400, "invalid_filename")
    assert service.stored_objects() == []


def test_bad_purpose_is_refused_before_the_file_is_read_and_quoted_short(service: Service) -> None:
    _, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key)
        upload.send(part("purpose", b"p" * 20000) + file_head() + LINE)
        assert upload.answered(5.0), "the purpose was only checked after the whole body"
        reply = upload.reply()
        upload.close()
    assert (reply.status, reply.error["param"]) == (400, "purpose")
    assert len(reply.error["message"]) < 400
    assert service.stored_objects() == []


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (part("purpose", b"bogus"), "purpose"),
        (b"", "purpose"),
        (part("purpose", b"batch") + part("expires_after[anchor]", b"now"), "expires_after.anchor"),
        (
            part("purpose", b"batch")
            + part("expires_after[anchor]", b"created_at")
            + part("expires_after[seconds]", b"9" * 5000),
            "expires_after.seconds",
        ),
        (part("purpose", b"batch") + part("expires_after[seconds]", b"7200"), "expires_after.anchor"),
    ],
)
def test_fields_after_the_file_are_checked_before_it_is_stored(service: Service, fields: bytes, param: str) -> None:
    team, key = api_key()
    with serve(build_app()) as port:
        response = post_body(port, key, file_part(LINE * 100) + fields + CLOSING)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert service.stored_objects() == [] and file_rows(team) == 0


# ---- an interrupted upload leaves nothing ----------------------------------------------------


def test_client_gone_mid_file_leaves_no_object(service: Service) -> None:
    team, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key, content_length=MAX_FILE_BYTES // 2)
        upload.send(part("purpose", b"batch") + file_head() + LINE * 2000)
        time.sleep(0.5)
        upload.close()
        time.sleep(1.0)
    assert service.stored_objects() == [] and file_rows(team) == 0


def test_body_ending_before_the_closing_boundary_is_not_stored(service: Service) -> None:
    team, key = api_key()
    with serve(build_app()) as port:
        response = post_body(port, key, part("purpose", b"batch") + file_head() + LINE * 100)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "upload_interrupted"
    assert service.stored_objects() == [] and file_rows(team) == 0


# ---- and honest uploads still work -----------------------------------------------------------


@pytest.mark.parametrize("file_first", [False, True])
def test_upload_round_trip(service: Service, file_first: bool) -> None:
    team, key = api_key()
    content = LINE * 5000
    with serve(build_app()) as port:
        response = post_body(port, key, valid_body(content, file_first=file_first))
        assert response.status_code == 200, response.text
        body = response.json()
        assert (body["bytes"], body["purpose"], body["filename"]) == (len(content), "batch", "input.jsonl")
        download = httpx.get(
            f"http://127.0.0.1:{port}/v1/files/{body['id']}/content",
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert download.content == content
    assert file_rows(team) == 1


def test_upload_idle_past_the_bound_is_ended_and_not_stored(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_UPLOAD_IDLE_TIMEOUT_S", "1")
    team, key = api_key()
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key)
        upload.send(part("purpose", b"batch") + file_head() + LINE)
        assert upload.answered(5.0), "a stalled upload was waited on without bound"
        reply = upload.reply()
        upload.close()
    assert reply.status == 408 and reply.error["type"] == "invalid_request_error"
    assert service.stored_objects() == [] and file_rows(team) == 0


def test_s3_client_gone_mid_file_leaves_no_object(s3_service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    # Past one 8 MiB multipart part, so a multipart upload is under way when the client goes.
    monkeypatch.setenv("BACKFILL_MAX_FILE_BYTES", str(64 * 1024 * 1024))
    reset_process_caches()
    team, key = api_key()
    big = 12 * 1024 * 1024
    with serve(build_app()) as port:
        upload = RawRequest(port, key=key, content_length=big)
        upload.send(part("purpose", b"batch") + file_head())
        for _ in range(10 * 1024 * 1024 // (len(LINE) * 1000)):
            upload.send(LINE * 1000)
        time.sleep(1.0)
        upload.close()
        time.sleep(2.0)
    assert s3_service.stored_objects() == [] and file_rows(team) == 0
    uploads = s3_service.s3.list_multipart_uploads(Bucket=s3_service.bucket).get("Uploads", [])
    assert uploads == [], "the interrupted multipart upload was left open"


def test_s3_body_ending_before_the_closing_boundary_is_not_stored(s3_service: Service) -> None:
    team, key = api_key()
    with serve(build_app()) as port:
        response = post_body(port, key, part("purpose", b"batch") + file_head() + LINE * 100)
        assert response.status_code == 400, response.text
        assert post_body(port, key, valid_body()).status_code == 200
    assert len(s3_service.stored_objects()) == 1 and file_rows(team) == 1
