"""A partial_output download that outlives its batch's line rows (retention retires the batch
between two of its pages) ends as a broken download the client sees, not as a short 200 body
passing for complete. Against a real HTTP server (uvicorn in a thread) on Postgres.

The pages read after the retirement come back empty; the stream used to end normally there, its
last chunk and all, with the lines read before. (The stream waits after its first page until the
test has retired the batch: a reader slower than retention's grace, without a slow socket.)"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import update

from backfill.api.routes import partial as partial_route
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.models import Batch, BatchStatus, utcnow
from backfill.jobs.output import pages as output_pages
from backfill.jobs.output.pages import result_lines
from backfill.jobs.retention import retire_batch
from backfill.storage.db import unit_of_work
from backfill.storage.process_state import reset as reset_process_state
from tests.api.conftest import ApiEnv, CheckedClient, Team
from tests.api.test_partial_output import LINES, _record, _running_batch

RETIRED = threading.Event()  # the test has retired the batch: the stream may go on


def _paused_after_first_page(*args: Any, **kwargs: Any) -> Iterator[bytes]:
    """The route's pages, the stream waiting after the first one until the test has retired the
    batch (a reader slower than retention's grace)."""
    pages = result_lines(*args, **kwargs)
    yield next(pages)
    RETIRED.wait(30)
    yield from pages


@pytest.fixture
def server(api_env: ApiEnv, api: CheckedClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The app served on a loopback port, a page per line, read no further ahead than one page."""
    from backfill.api.app import create_app

    monkeypatch.setattr(output_pages, "ROWS_PER_FETCH", 1)
    monkeypatch.setattr(output_pages, "PG_AHEAD", 1)  # the next page is read once the last is sent
    monkeypatch.setattr(partial_route, "result_lines", _paused_after_first_page)
    RETIRED.clear()
    reset_process_state()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    served = uvicorn.Server(uvicorn.Config(create_app(), log_level="warning", lifespan="off"))
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
        monkeypatch.undo()
        reset_process_state()


def _finished(batch_id: str) -> None:
    """The batch as finalization leaves it: completed, its files written (ids stand in for them)."""
    with unit_of_work() as s:
        s.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(status=BatchStatus.completed, completed_at=utcnow(), output_file_id="file-out")
        )


def test_a_download_spanning_the_batchs_retirement_ends_with_an_error(
    server: str, api: CheckedClient, team: Team
) -> None:
    wire_id, batch_id = _running_batch(api, team)
    _record(batch_id, *((n, Outcome(200, b"{}", "r", Usage(1, 0, 1))) for n in range(1, LINES + 1)))
    _finished(batch_id)
    got = b""
    with (
        httpx.Client(base_url=f"http://{server}", headers=team.headers, timeout=60) as client,
        client.stream("GET", f"/v1/batches/{wire_id}/partial_output") as r,
    ):
        assert r.status_code == 200
        chunks = r.iter_raw()
        got += next(chunks)
        with unit_of_work() as s:  # retention's step, grace 0, for this batch (others are not ours)
            assert retire_batch(s, batch_id, now=utcnow()) == (True, True)
        RETIRED.set()
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in chunks:
                got += chunk
    assert got.count(b"\n") < LINES  # lines were missing: the error is the client's only sign of it


def test_a_download_of_a_batch_left_alone_ends_whole(server: str, api: CheckedClient, team: Team) -> None:
    RETIRED.set()
    wire_id, batch_id = _running_batch(api, team)
    _record(batch_id, *((n, Outcome(200, b"{}", "r", Usage(1, 0, 1))) for n in range(1, LINES + 1)))
    _finished(batch_id)
    with httpx.Client(base_url=f"http://{server}", headers=team.headers, timeout=60) as client:
        r = client.get(f"/v1/batches/{wire_id}/partial_output")
    assert r.status_code == 200 and len(r.content.splitlines()) == LINES
