"""Retention: what backfill keeps, and for how long.

Run by the scheduler loop every `retention_interval_s`. A pass is many short transactions, never
one long one (the loop does nothing else meanwhile, and a long transaction holds back vacuum and
the locks it took): `run_retention` takes a unit of work to open each one with. Every step is
idempotent and bounded, so a crash mid-way is finished by the next pass.

- The object of an expired or deleted file is removed once no unfinished batch reads it: each
  file in a transaction of its own.
- Objects without a file row (an upload or finalization that died before its row was
  written) are collected after a grace period long enough for a live one to finish; the store
  is deleted from outside any transaction.
- A batch is retired once it ended a grace period ago (a finalization redelivered inside it still
  reads its lines): its line rows (its request index, with the fleet's response bodies; the
  result files keep them) leave the database and its ledger is rolled up (`jobs.billing.rollup`),
  one transaction per batch, at most `batches_per_pass` batches a pass. A finished batch then
  leaves a few rows, however many lines it had.
- The parts of an upload (`jobs.uploads`) that will never complete (expired, cancelled, or a
  completion that died) leave the object store and the database, each upload in a transaction
  of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, delete, exists, or_, select, text, update
from sqlalchemy.orm import Session

from backfill.jobs.billing.rollup import roll_up_ledger
from backfill.jobs.models import TERMINAL_STATUSES, UNRETIRED_SQL, Batch, BatchRequest, File, utcnow
from backfill.jobs.uploads import clean_up_uploads
from backfill.storage.db import UnitOfWork
from backfill.storage.objects import ObjectStore

# Opens one transaction: commits when the block ends, rolls back if it raises
# (`storage.db.unit_of_work`, or a sessionmaker's `begin`).

OBJECT_PREFIXES = ("files/", "batches/")


@dataclass(frozen=True)
class RetentionPolicy:
    orphan_grace_s: float = 3600.0
    # Seconds after a batch ends before its line rows leave the database; < 0 keeps them.
    result_body_grace_s: float = 3600.0
    batch_size: int = 500  # file objects and orphans a pass
    # Batches retired a pass (each its own transaction; a large one deletes many line rows). The
    # scheduler runs the next pass on its next tick while a pass fills this (`Ticker.retain`).
    batches_per_pass: int = 20


@dataclass
class RetentionReport:
    file_objects: int = 0
    orphans: int = 0
    body_batches: int = 0  # batches whose line rows were removed
    ledgers: int = 0  # batches whose ledger was rolled up
    retired: int = 0  # batches retired (the two above): `batches_per_pass` says more may be left
    uploads: int = 0  # uploads whose parts were removed (expired or cancelled)

    def __bool__(self) -> bool:
        return bool(self.file_objects or self.orphans or self.body_batches or self.ledgers or self.uploads)


def _purgeable_file(now: datetime) -> ColumnElement[bool]:
    """An expired or deleted file not purged yet that no unfinished batch reads."""
    in_use = exists().where(Batch.input_file_id == File.id, Batch.status.not_in([s.value for s in TERMINAL_STATUSES]))
    return and_(File.purged_at.is_(None), or_(File.deleted_at <= now, File.expires_at <= now), ~in_use)


def purge_file_objects(transaction: UnitOfWork, store: ObjectStore, *, now: datetime, limit: int) -> int:
    """Remove the objects of expired and deleted files that no unfinished batch still reads, each
    in a short transaction of its own that checks the file again (a batch may have started
    reading it since it was listed). A file another replica is purging right now is skipped (its
    row locked): a scheduler resumed mid-pass and the one leading now never both delete it."""
    with transaction() as session:
        file_ids = list(session.execute(select(File.id).where(_purgeable_file(now)).limit(limit)).scalars())
    purged = 0
    for file_id in file_ids:
        with transaction() as session:
            row = session.execute(
                select(File).where(File.id == file_id, _purgeable_file(now)).with_for_update(skip_locked=True)
            ).scalar_one_or_none()
            if row is None:
                continue
            store.delete(row.object_key)  # deleting a missing object is a no-op: safe to repeat
            row.purged_at = now
            purged += 1
    return purged


ORPHAN_CHECK_CHUNK = 200  # object keys looked up in one query


def collect_orphans(transaction: UnitOfWork, store: ObjectStore, *, now: datetime, grace_s: float, limit: int) -> int:
    """Delete objects older than the grace period that no file row names: the keys are looked up
    in chunks, each in a short read, and the store deleted from outside any transaction."""
    cutoff = now - timedelta(seconds=grace_s)
    removed = 0
    chunk: list[str] = []

    def sweep() -> int:
        with transaction() as session:
            known = set(session.execute(select(File.object_key).where(File.object_key.in_(chunk))).scalars())
        orphans = [key for key in chunk if key not in known][: limit - removed]
        for key in orphans:
            store.delete(key)
        chunk.clear()
        return len(orphans)

    for prefix in OBJECT_PREFIXES:
        for obj in store.list(prefix):
            if removed >= limit:
                return removed
            if obj.last_modified <= cutoff:
                chunk.append(obj.key)
            if len(chunk) >= ORPHAN_CHECK_CHUNK:
                removed += sweep()
    if chunk and removed < limit:
        removed += sweep()
    return removed


def ended_before(cutoff: datetime) -> ColumnElement[bool]:
    return or_(
        and_(Batch.completed_at.is_not(None), Batch.completed_at <= cutoff),
        and_(Batch.expired_at.is_not(None), Batch.expired_at <= cutoff),
        and_(Batch.cancelled_at.is_not(None), Batch.cancelled_at <= cutoff),
    )


def _files_written() -> ColumnElement[bool]:
    return Batch.output_file_id.is_not(None) | Batch.error_file_id.is_not(None)


def batches_to_retire(session: Session, *, ended: ColumnElement[bool], limit: int) -> list[str]:
    """Terminal batches that ended (`ended`) with a ledger not rolled up yet, or with line rows
    still to delete. Chosen by the ledger, not by `bodies_purged_at` alone: the code before
    migration 0011 marked a batch purged when it nulled its bodies, leaving its line rows and its
    per-line ledger, and until retirement was one step a pass could roll up a batch's ledger
    without deleting its lines."""
    query = select(Batch.id).where(
        Batch.status.in_([s.value for s in TERMINAL_STATUSES]),
        # The partial index's own predicate, word for word: SQLite uses a partial index only then.
        text(f"({UNRETIRED_SQL})"),
        Batch.ledger_rolled_up_at.is_(None) | (Batch.bodies_purged_at.is_(None) & _files_written()),
        ended,
    )
    return list(session.execute(query.limit(limit)).scalars())


def retire_batch(session: Session, batch_id: str, *, now: datetime) -> tuple[bool, bool]:
    """Roll up the batch's ledger and delete its line rows, in the caller's transaction, so the
    two and the timestamps saying so commit together. The line rows go only once the result files
    are written (they then hold every line). Both steps are idempotent (the rollup is a
    compare-and-set on `ledger_rolled_up_at`), so another replica retiring the same batch changes
    nothing. Returns (ledger rolled up now, line rows deleted now)."""
    rolled_up = bool(roll_up_ledger(session, batch_id, now=now))
    if session.execute(select(Batch.id).where(Batch.id == batch_id, _files_written())).first() is None:
        return rolled_up, False
    deleted = session.execute(
        delete(BatchRequest).where(BatchRequest.batch_id == batch_id).execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    mark = update(Batch).where(Batch.id == batch_id).values(bodies_purged_at=now)
    if not deleted:  # (rows the old code emptied keep the time they were emptied)
        mark = mark.where(Batch.bodies_purged_at.is_(None))
    marked = session.execute(mark.execution_options(synchronize_session=False)).rowcount  # type: ignore[attr-defined]
    return rolled_up, bool(deleted or marked)


def retire_ended_batches(transaction: UnitOfWork, *, now: datetime, grace_s: float, limit: int) -> RetentionReport:
    """Retire up to `limit` batches that ended `grace_s` ago, one transaction each; none when the
    grace is negative (line rows and per-line ledger kept)."""
    report = RetentionReport()
    if grace_s < 0:
        return report
    with transaction() as session:
        batch_ids = batches_to_retire(session, ended=ended_before(now - timedelta(seconds=grace_s)), limit=limit)
    for batch_id in batch_ids:
        with transaction() as session:
            rolled_up, purged = retire_batch(session, batch_id, now=now)
        report.ledgers += rolled_up
        report.body_batches += purged
    report.retired = len(batch_ids)
    return report


def run_retention(
    transaction: UnitOfWork, store: ObjectStore, *, policy: RetentionPolicy, now: datetime | None = None
) -> RetentionReport:
    """One retention pass, in short transactions opened with `transaction`."""
    now = now or utcnow()
    report = retire_ended_batches(
        transaction, now=now, grace_s=policy.result_body_grace_s, limit=policy.batches_per_pass
    )
    report.file_objects = purge_file_objects(transaction, store, now=now, limit=policy.batch_size)
    report.orphans = collect_orphans(
        transaction, store, now=now, grace_s=policy.orphan_grace_s, limit=policy.batch_size
    )
    report.uploads = clean_up_uploads(transaction, store, now=now, limit=policy.batch_size)
    return report
