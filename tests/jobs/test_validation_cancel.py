"""A batch cancelled while it validates ends `cancelled`, whatever its file holds, and validation
stops writing its index: at the end of the scan (nothing is recorded) or between index parts
(the lines written so far are the batch's; finalization writes them as cancelled)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs import batches, sweeps
from backfill.jobs.models import Batch, BatchRequest, BatchStatus
from backfill.jobs.output import finalize as output
from backfill.jobs.validation import outcome as validation
from backfill.jobs.validation.outcome import apply_validation, write_index_parts
from backfill.jobs.validation.scan import Limits, validate_lines
from backfill.storage.objects import LocalObjectStore
from tests.jobs.test_validation_index import CHAT, _new_batch, _validated

LINES = 40


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "FIRST_INDEX_PART", 6)
    monkeypatch.setattr(validation, "INDEX_PART", 7)


def _cancel(db: sessionmaker[Session], batch_id: str) -> None:
    with db.begin() as s:
        assert batches.cancel_batch(s, team_id=None, batch_id=batch_id).status == BatchStatus.cancelling


def _rows(db: sessionmaker[Session], batch_id: str) -> int:
    with db() as s:
        return len(s.execute(select(BatchRequest.line).where(BatchRequest.batch_id == batch_id)).all())


def _finalized(db: sessionmaker[Session], batch_id: str, tmp_path: Path) -> Batch:
    """What the scheduler loop does with a settled cancelling batch: finalize it."""
    with db() as s:
        assert batch_id in sweeps.batches_to_finalize(s)
    assert output.finalize_batch(db.begin, LocalObjectStore(tmp_path), batch_id=batch_id) == BatchStatus.cancelled
    with db() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None
        return batch


def test_a_batch_cancelled_while_validating_a_file_with_errors_ends_cancelled(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    bad = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\nnot json\n'
    result = validate_lines([bad], endpoint=CHAT, served_models=None, limits=Limits(10, 1000, 10))
    assert result.errors
    batch_id = _new_batch(db)
    _cancel(db, batch_id)
    with db.begin() as s:
        assert apply_validation(s, batch_id=batch_id, result=result) == BatchStatus.cancelling
    batch = _finalized(db, batch_id, tmp_path)
    assert (batch.status, batch.failed_at, batch.total) == (BatchStatus.cancelled, None, 0)
    assert batch.cancelled_at is not None


def test_a_batch_cancelled_before_its_validation_is_recorded_gets_no_index(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    result = _validated(LINES)
    batch_id = _new_batch(db)
    _cancel(db, batch_id)
    with db.begin() as s:
        assert apply_validation(s, batch_id=batch_id, result=result) == BatchStatus.cancelling
    assert write_index_parts(db.begin, batch_id=batch_id, requests=result.requests) == 0
    assert _rows(db, batch_id) == 0
    batch = _finalized(db, batch_id, tmp_path)
    assert (batch.status, batch.total, batch.unindexed) == (BatchStatus.cancelled, 0, 0)


def test_validation_stops_writing_the_index_of_a_batch_cancelled_between_parts(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    result = _validated(LINES)
    batch_id = _new_batch(db)
    with db.begin() as s:
        assert apply_validation(s, batch_id=batch_id, result=result) == BatchStatus.in_progress
    _cancel(db, batch_id)  # the first part is in: the batch was running
    assert write_index_parts(db.begin, batch_id=batch_id, requests=result.requests) == 6
    assert _rows(db, batch_id) == 6  # no part after the cancel
    batch = _finalized(db, batch_id, tmp_path)
    # The batch is the lines it had when cancelled; each is written as cancelled.
    assert (batch.status, batch.total, batch.unindexed, batch.failed) == (BatchStatus.cancelled, 6, 0, 6)
    assert batch.error_file_id is not None
    errors = b"".join(LocalObjectStore(tmp_path).open(output.output_key(batch.team_id, batch_id, "error")))
    assert errors.count(b"batch_cancelled") == 6
