"""Slow partial_output readers against a real HTTP server (uvicorn in a thread, the app as in
production) on a small database pool: downloads stalled after their first bytes hold no
connection, so authenticated routes keep answering, and one key streams only
`max_partial_downloads_per_key` downloads at once (the next gets 429 in OpenAI's envelope).

A download used to hold a session, and with it a pooled connection and an open transaction,
for as long as its reader took: a few stalled readers of one team took the whole pool and
every route (authentication first) waited for a connection."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from sqlalchemy import create_engine

from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.output import pages as output_pages
from backfill.storage import db as storage_db
from backfill.storage.process_state import reset as reset_process_state
from tests.api.conftest import ApiEnv, CheckedClient, Team
from tests.api.test_partial_output import LINES, _record, _running_batch

POOL = 2  # connections in the server's pool: fewer than the stalled readers
READERS = 3  # stalled downloads of one key: the cap
BODY = 4 * 1024 * 1024  # each answer: 20 MB a download, far past what socket buffers hold


@pytest.fixture
def server(api_env: ApiEnv, api: CheckedClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The app served on a loopback port, on an engine of POOL connections (waits for one
    give up after 10 s), READERS partial downloads allowed per key."""
    from backfill.api.app import create_app

    monkeypatch.setenv("BACKFILL_MAX_PARTIAL_DOWNLOADS_PER_KEY", str(READERS))
    monkeypatch.setattr(output_pages, "ROWS_PER_FETCH", 1)  # a page a line: a download of five pages
    monkeypatch.setattr(
        storage_db, "make_engine", lambda url: create_engine(url, pool_size=POOL, max_overflow=0, pool_timeout=10)
    )
    reset_process_state()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(), log_level="warning", lifespan="off")
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not served.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.started, "the server never started"
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        served.should_exit = True
        thread.join(30)
        storage_db.get_engine().dispose()
        monkeypatch.undo()
        reset_process_state()


def _stalled_download(address: str, path: str, key: str) -> socket.socket:
    """A download that reads its headers and first bytes, then nothing more (a tiny receive
    window, so the server's sends soon block)."""
    host, port = address.split(":")
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.settimeout(60)
    conn.connect((host, int(port)))
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: backfill.test\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head or len(head.split(b"\r\n\r\n", 1)[1]) < 1024:
        chunk = conn.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return conn


def test_stalled_readers_hold_no_connection_and_one_key_streams_a_bounded_number(
    server: str, api: CheckedClient, team: Team
) -> None:
    wire_id, batch_id = _running_batch(api, team)
    big = Outcome(status_code=200, body=b'{"e":"' + b"7" * BODY + b'"}', request_id="r", usage=Usage(1, 0, 1))
    _record(batch_id, *((n, big) for n in range(1, LINES + 1)))
    path = f"/v1/batches/{wire_id}/partial_output"
    readers = [_stalled_download(server, path, team.key) for _ in range(READERS)]
    try:
        with httpx.Client(base_url=f"http://{server}", headers=team.headers, timeout=60) as client:
            listed = client.get("/v1/batches")  # authentication and a query: each needs a connection
            assert listed.status_code == 200, listed.text
            assert client.get(f"/v1/batches/{wire_id}").status_code == 200
            refused = client.get(path)
            assert refused.status_code == 429, refused.text[:200]
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and "partial_output downloads" in error["message"]
            assert refused.headers["retry-after"]
    finally:
        for reader in readers:
            reader.close()
    # The slots come back once the readers have gone: a whole download goes through again.
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=f"http://{server}", headers=team.headers, timeout=60) as client:
        while (whole := client.get(path)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert whole.status_code == 200 and len(whole.content.splitlines()) == LINES
