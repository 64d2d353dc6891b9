"""Retention on a real database and a real object store: what is removed, what must stay."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.models import Batch, BatchRequest, BatchStatus, File, RequestState, new_id, utcnow
from backfill.jobs.retention import RetentionPolicy, run_retention
from backfill.jobs.teams import get_or_create_team
from backfill.storage.objects import LocalObjectStore
from tests.factories import make_submitted_batch

LATER = timedelta(hours=2)  # past every grace period below


def _file(session: Session, store: LocalObjectStore, team_id: str, **kw: object) -> File:
    file_id = new_id()
    key = f"files/{team_id}/{file_id}"
    store.put(key, [b'{"x": 1}\n'])
    row = File(id=file_id, team_id=team_id, purpose="batch", filename="in.jsonl", bytes=9, object_key=key, **kw)
    session.add(row)
    session.flush()
    return row


def _batch(session: Session, team_id: str, input_file_id: str, status: BatchStatus, **kw: object) -> Batch:
    return make_submitted_batch(session, team_id, status=status, input_file_id=input_file_id, **kw)


def _keys(store: LocalObjectStore) -> set[str]:
    return {o.key for prefix in ("files/", "batches/") for o in store.list(prefix)}


def test_expired_and_deleted_file_objects_go_once_no_unfinished_batch_reads_them(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    now = utcnow()
    with db.begin() as s:
        team = get_or_create_team(s, name="t").id
        expired = _file(s, store, team, expires_at=now - timedelta(seconds=1))
        deleted = _file(s, store, team, deleted_at=now)
        live = _file(s, store, team, expires_at=now + timedelta(days=1))
        read_by_running = _file(s, store, team, deleted_at=now)
        running = _batch(s, team, read_by_running.id, BatchStatus.in_progress)
        keys = {f.id: f.object_key for f in (expired, deleted, live, read_by_running)}

    policy = RetentionPolicy(orphan_grace_s=3600, result_body_grace_s=-1)
    report = run_retention(db.begin, store, policy=policy, now=now + timedelta(seconds=1))
    assert report.file_objects == 2
    assert _keys(store) == {keys[live.id], keys[read_by_running.id]}

    with db.begin() as s:  # the batch ends: its deleted input may go now
        s.get(Batch, running.id).status = BatchStatus.completed  # type: ignore[union-attr]
    assert run_retention(db.begin, store, policy=policy).file_objects == 1
    with db.begin() as s:
        purged = s.execute(select(File.id).where(File.purged_at.is_not(None))).scalars().all()
    assert set(purged) == {expired.id, deleted.id, read_by_running.id}
    assert _keys(store) == {keys[live.id]}
    # nothing left to do: a second pass changes nothing
    assert not run_retention(db.begin, store, policy=policy)


def test_orphaned_objects_are_collected_after_the_grace_period(db: sessionmaker[Session], tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    with db.begin() as s:
        team = get_or_create_team(s, name="t").id
        known = _file(s, store, team)
    store.put(f"files/{team}/interrupted-upload", [b"half a li"])
    store.put(f"batches/{team}/b1/output.jsonl", [b"{}\n"])  # a finalization that died before its row

    policy = RetentionPolicy(orphan_grace_s=3600, result_body_grace_s=-1)
    assert run_retention(db.begin, store, policy=policy).orphans == 0  # young: maybe an upload still in flight
    assert run_retention(db.begin, store, policy=policy, now=utcnow() + LATER).orphans == 2
    assert _keys(store) == {known.object_key}


def test_line_rows_leave_the_database_after_the_files_are_written(db: sessionmaker[Session], tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    with db.begin() as s:
        team = get_or_create_team(s, name="t").id
        source = _file(s, store, team)
        done = _batch(s, team, source.id, BatchStatus.completed, completed_at=utcnow(), output_file_id="out1")
        running = _batch(s, team, source.id, BatchStatus.in_progress)
        for batch in (done, running):
            s.add(
                BatchRequest(
                    batch_id=batch.id,
                    line=1,
                    custom_id="a",
                    offset=0,
                    length=9,
                    state=RequestState.succeeded,
                    response_body='{"ok": true}',
                )
            )
        done_id, running_id = done.id, running.id

    policy = RetentionPolicy(orphan_grace_s=3600, result_body_grace_s=3600)
    # inside the grace period a redelivered finalization may still read them
    assert run_retention(db.begin, store, policy=policy).body_batches == 0
    assert run_retention(db.begin, store, policy=policy, now=utcnow() + LATER).body_batches == 1
    with db.begin() as s:
        bodies = {r[0]: r[1] for r in s.execute(select(BatchRequest.batch_id, BatchRequest.response_body))}
        assert bodies == {running_id: '{"ok": true}'}  # the finished batch's line rows are gone
        assert s.get(Batch, done_id).bodies_purged_at is not None  # type: ignore[union-attr]
    assert run_retention(db.begin, store, policy=policy, now=utcnow() + LATER).body_batches == 0
