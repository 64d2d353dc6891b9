"""Retention: what backfill keeps, and for how long.

Run by the scheduler loop every `retention_interval_s`; each step is idempotent and bounded
(at most `batch_size` rows a pass), so a crash mid-way is finished by the next pass.

- The object of an expired or deleted file is removed once no unfinished batch reads it.
- Objects without a file row (an upload or finalization that died before its row was
  written) are collected after a grace period long enough for a live one to finish.
- A batch's line rows (its request index, with the fleet's response bodies) leave the database
  once its result files are written and a grace period has passed (a finalization redelivered
  inside it still reads them); its ledger is rolled up at the same time (`jobs.ledger_rollup`).
  A finished batch then leaves a few rows, however many lines it had.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, delete, exists, or_, select, update
from sqlalchemy.orm import Session

from backfill.jobs.ledger_rollup import roll_up_ledgers
from backfill.jobs.models import TERMINAL_STATUSES, Batch, BatchRequest, File, utcnow
from backfill.storage.objects import ObjectStore

OBJECT_PREFIXES = ("files/", "batches/")


@dataclass(frozen=True)
class RetentionPolicy:
    orphan_grace_s: float = 3600.0
    # Seconds after a batch ends before its line rows leave the database; < 0 keeps them.
    result_body_grace_s: float = 3600.0
    batch_size: int = 500


@dataclass
class RetentionReport:
    file_objects: int = 0
    orphans: int = 0
    body_batches: int = 0  # batches whose line rows were removed
    ledgers: int = 0  # batches whose ledger was rolled up

    def __bool__(self) -> bool:
        return bool(self.file_objects or self.orphans or self.body_batches or self.ledgers)


def purge_file_objects(session: Session, store: ObjectStore, *, now: datetime, limit: int) -> int:
    """Remove the objects of expired and deleted files that no unfinished batch still reads."""
    in_use = exists().where(Batch.input_file_id == File.id, Batch.status.not_in([s.value for s in TERMINAL_STATUSES]))
    rows = list(
        session.execute(
            select(File)
            .where(
                File.purged_at.is_(None),
                or_(File.deleted_at <= now, File.expires_at <= now),
                ~in_use,
            )
            .limit(limit)
        ).scalars()
    )
    for row in rows:
        store.delete(row.object_key)  # deleting a missing object is a no-op: safe to repeat
        row.purged_at = now
    session.flush()
    return len(rows)


def collect_orphans(session: Session, store: ObjectStore, *, now: datetime, grace_s: float, limit: int) -> int:
    """Delete objects older than the grace period that no file row names."""
    cutoff = now - timedelta(seconds=grace_s)
    removed = 0
    for prefix in OBJECT_PREFIXES:
        for obj in store.list(prefix):
            if removed >= limit:
                return removed
            if obj.last_modified > cutoff:
                continue
            known = session.execute(select(File.id).where(File.object_key == obj.key).limit(1)).first()
            if known is None:
                store.delete(obj.key)
                removed += 1
    return removed


def ended_before(cutoff: datetime) -> ColumnElement[bool]:
    return or_(
        and_(Batch.completed_at.is_not(None), Batch.completed_at <= cutoff),
        and_(Batch.expired_at.is_not(None), Batch.expired_at <= cutoff),
        and_(Batch.cancelled_at.is_not(None), Batch.cancelled_at <= cutoff),
    )


def purge_result_bodies(session: Session, *, now: datetime, grace_s: float, limit: int) -> int:
    """Delete the line rows of batches whose result files were written long enough ago."""
    if grace_s < 0:
        return 0
    ended = ended_before(now - timedelta(seconds=grace_s))
    batch_ids = list(
        session.execute(
            select(Batch.id)
            .where(
                Batch.status.in_([s.value for s in TERMINAL_STATUSES]),
                Batch.output_file_id.is_not(None) | Batch.error_file_id.is_not(None),
                Batch.bodies_purged_at.is_(None),
                ended,
            )
            .limit(limit)
        ).scalars()
    )
    for batch_id in batch_ids:
        session.execute(
            delete(BatchRequest).where(BatchRequest.batch_id == batch_id).execution_options(synchronize_session=False)
        )
        session.execute(update(Batch).where(Batch.id == batch_id).values(bodies_purged_at=now))
    return len(batch_ids)


def run_retention(
    session: Session, store: ObjectStore, *, policy: RetentionPolicy, now: datetime | None = None
) -> RetentionReport:
    now = now or utcnow()
    grace_s, limit = policy.result_body_grace_s, policy.batch_size
    return RetentionReport(
        file_objects=purge_file_objects(session, store, now=now, limit=limit),
        orphans=collect_orphans(session, store, now=now, grace_s=policy.orphan_grace_s, limit=limit),
        body_batches=purge_result_bodies(session, now=now, grace_s=grace_s, limit=limit),
        # After the same grace: the per-line rows stay readable while a finished batch is fresh.
        ledgers=0
        if grace_s < 0
        else roll_up_ledgers(session, now=now, ended=ended_before(now - timedelta(seconds=grace_s)), limit=limit),
    )
