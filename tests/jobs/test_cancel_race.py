"""A cancel that races a claim in flight: the claim read the batch as in progress and has not
committed. The cancel must wait for it (the claim holds FOR KEY SHARE on the batch row; the
cancel takes FOR UPDATE first, as expiry does), so the claimed lines are seen running and the
batch drains them before it is finalized: each lands in the output or error file. A plain
UPDATE does not conflict with FOR KEY SHARE: the cancel committed at once, finalization found
nothing running and wrote the claimed lines as cancelled, then the claim committed, ran them
and billed them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.batches import cancel_batch
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcomes
from backfill.jobs.models import Batch, BatchStatus, RequestState
from backfill.jobs.output.finalize import finalize_batch, output_key
from backfill.storage.objects import LocalObjectStore
from tests.jobs.test_output import _batch, _files


def _cancel(db: sessionmaker[Session], batch_id: str) -> str:
    with db.begin() as s:
        return cancel_batch(s, team_id=None, batch_id=batch_id).status


def test_a_cancel_waits_for_a_claim_in_flight_and_its_lines_land_in_the_files(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    if db.kw["bind"].dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: a claim and a cancel cannot overlap there")
    with db.begin() as s:
        batch = _batch(s, status=BatchStatus.in_progress, states={n: RequestState.pending for n in range(1, 6)})
        batch_id, team_id = batch.id, batch.team_id
    claiming = db()
    claiming.begin()
    claimed = [c.line for c in claim_requests(claiming, batch_id=batch_id, limit=2, claim_token="in-flight")]
    assert claimed == [1, 2]
    with ThreadPoolExecutor(1) as pool:
        cancelling = pool.submit(_cancel, db, batch_id)
        try:
            with pytest.raises(TimeoutError):
                cancelling.result(timeout=1.0)  # waits for the claim
        finally:
            claiming.commit()
            claiming.close()
        assert cancelling.result(timeout=30) == BatchStatus.cancelling
    store = LocalObjectStore(tmp_path / "objects")
    # The claimed lines run: the batch waits for them before it is written.
    assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.cancelling
    answer = Outcome(status_code=200, body=b'{"ok":true}', request_id="fleet", usage=Usage(3, 0, 2))
    with db.begin() as s:
        assert record_outcomes(s, claim_token="in-flight", results=[(batch_id, n, answer) for n in claimed]) == 2
    assert finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.cancelled
    files = _files(store, team_id, batch_id)
    out = [orjson.loads(x) for x in files[output_key(team_id, batch_id, "output")].splitlines()]
    err = [orjson.loads(x) for x in files[output_key(team_id, batch_id, "error")].splitlines()]
    assert [x["custom_id"] for x in out] == ["req-1", "req-2"]
    assert [(x["custom_id"], x["error"]["code"]) for x in err] == [(f"req-{n}", "batch_cancelled") for n in (3, 4, 5)]
    with db() as s:
        done = s.get(Batch, batch_id)
        assert done is not None and (done.completed, done.failed) == (2, 3)
