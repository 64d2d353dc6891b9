"""A large index is written in parts: the batch runs from its first part, the rest follows in
release order (each part its own transaction, counted on the batch), a validation that stopped
midway is resumed where the count says, and no batch is finalized before its last line is in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs import sweeps
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, RequestState, utcnow
from backfill.jobs.output import finalize as output
from backfill.jobs.validation import outcome as validation
from backfill.jobs.validation.outcome import apply_validation, write_index_parts
from backfill.storage.objects import LocalObjectStore
from tests.jobs.test_validation_index import _new_batch, _stored, _validated

LINES = 40


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "FIRST_INDEX_PART", 6)
    monkeypatch.setattr(validation, "INDEX_PART", 7)


def _indexed(db: sessionmaker[Session], batch_id: str) -> tuple[int, int, BatchStatus]:
    with db() as s:
        b = s.get(Batch, batch_id)
        assert b is not None
        return b.total - b.unindexed, b.total, b.status


def _finish_all_written(db: sessionmaker[Session], batch_id: str) -> None:
    """Every line written so far answered (as a drain would record them)."""
    with db.begin() as s:
        s.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id)
            .values(state=RequestState.succeeded, status_code=200, response_body='{"ok":true}')
        )


def test_the_batch_runs_from_its_first_part_and_the_rest_follows_in_release_order(
    db: sessionmaker[Session],
) -> None:
    result = _validated(LINES)
    batch_id = _new_batch(db)
    with db.begin() as s:
        assert apply_validation(s, batch_id=batch_id, result=result) == BatchStatus.in_progress
    assert _indexed(db, batch_id) == (6, LINES, BatchStatus.in_progress)
    ranks = sorted(r["prefix_rank"] for r in _stored(db, batch_id))
    assert ranks == list(range(6)), "the first part is the first lines of the release order"

    assert write_index_parts(db.begin, batch_id=batch_id, requests=result.requests) == LINES
    assert _indexed(db, batch_id) == (LINES, LINES, BatchStatus.in_progress)
    expected = [{**row, "state": RequestState.pending, "attempts": 0} for row in result.requests]
    assert _stored(db, batch_id) == expected  # the rows one write of the whole index gives
    # Done is done: a redelivered validation writes nothing more.
    assert write_index_parts(db.begin, batch_id=batch_id, requests=result.requests) == LINES
    assert len(_stored(db, batch_id)) == LINES


def test_release_order_never_puts_a_line_before_the_line_it_waits_for() -> None:
    """A line waits for its `after_line` only while that line's row exists: so the release
    order, in which the parts are written, must put every `after_line` first."""
    result = _validated(LINES)
    rank = {row["line"]: row["prefix_rank"] for row in result.requests}
    waiting = [row for row in result.requests if row["after_line"]]
    assert waiting
    assert all(rank[row["after_line"]] < row["prefix_rank"] for row in waiting)


def _dies_after(db: sessionmaker[Session], commits: int) -> Callable[[], AbstractContextManager[Session]]:
    """Units of work that let `commits` transactions through, then fail the next one midway,
    as a worker killed during the write would."""
    seen = {"n": 0}

    @contextmanager
    def units() -> Iterator[Session]:
        seen["n"] += 1
        with db.begin() as s:
            yield s
            if seen["n"] > commits:
                raise RuntimeError("worker killed")

    return units


def test_a_write_stopped_midway_is_resumed_where_its_count_says(db: sessionmaker[Session]) -> None:
    result = _validated(LINES)
    batch_id = _new_batch(db)
    with db.begin() as s:
        apply_validation(s, batch_id=batch_id, result=result)
    with pytest.raises(RuntimeError, match="worker killed"):
        write_index_parts(_dies_after(db, commits=2), batch_id=batch_id, requests=result.requests)
    assert _indexed(db, batch_id)[0] == 6 + 2 * 7  # the two parts that committed, not the third
    assert len(_stored(db, batch_id)) == 6 + 2 * 7
    # The next validation scans the file again (the same index) and continues.
    assert write_index_parts(db.begin, batch_id=batch_id, requests=_validated(LINES).requests) == LINES
    expected = [{**row, "state": RequestState.pending, "attempts": 0} for row in result.requests]
    assert _stored(db, batch_id) == expected


def test_no_batch_is_finalized_before_its_last_line_is_indexed(db: sessionmaker[Session], tmp_path: Path) -> None:
    result = _validated(LINES)
    batch_id = _new_batch(db)
    with db.begin() as s:
        apply_validation(s, batch_id=batch_id, result=result)
    _finish_all_written(db, batch_id)  # nothing pending or running among the rows there are
    store = LocalObjectStore(tmp_path)
    with db() as s:
        assert batch_id not in sweeps.batches_to_finalize(s)
    assert output.finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.in_progress

    write_index_parts(db.begin, batch_id=batch_id, requests=result.requests)
    _finish_all_written(db, batch_id)
    with db() as s:
        assert batch_id in sweeps.batches_to_finalize(s)
    assert output.finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.completed
    with db() as s:
        b = s.get(Batch, batch_id)
        assert b is not None and b.output_file_id is not None
    out = b"".join(store.open(output.output_key(b.team_id, batch_id, "output")))
    assert out.count(b"\n") == LINES


def test_a_batch_that_expires_while_indexing_writes_its_late_lines_as_expired(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    result = _validated(LINES)
    batch_id = _new_batch(db)
    with db.begin() as s:
        apply_validation(s, batch_id=batch_id, result=result)
    with db.begin() as s:
        s.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=utcnow() - timedelta(seconds=1)))
    with db.begin() as s:
        assert sweeps.expire_overdue(s) == [batch_id]
    store = LocalObjectStore(tmp_path)
    with db() as s:
        assert batch_id not in sweeps.batches_to_finalize(s)
        assert sweeps.indexing_batches(s, started_before=utcnow() + timedelta(seconds=1)) == [batch_id]
    assert output.finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.finalizing

    write_index_parts(db.begin, batch_id=batch_id, requests=result.requests)
    with db() as s:
        assert sweeps.indexing_batches(s, started_before=utcnow() + timedelta(seconds=1)) == []
        assert batch_id in sweeps.batches_to_finalize(s)
    assert output.finalize_batch(db.begin, store, batch_id=batch_id) == BatchStatus.expired
    with db() as s:
        b = s.get(Batch, batch_id)
        assert b is not None and b.failed == LINES and b.error_file_id is not None
        lines = {r.line for r in s.execute(select(BatchRequest.line).where(BatchRequest.batch_id == batch_id))}
    assert len(lines) == LINES
    errors = b"".join(store.open(output.output_key(b.team_id, batch_id, "error")))
    assert errors.count(b"batch_expired") == LINES
