"""Sweeps the scheduler loop runs over all batches: expiry, cancellation, reclaiming lines whose
worker died, and finding the batches to finalize or to dispatch.

Each is idempotent and a compare-and-set on states, so two schedulers are merely wasteful.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from jobs.models import Batch, BatchRequest, BatchStatus, RequestState, utcnow


def running_claim_tokens(session: Session) -> list[str]:
    rows = session.execute(
        select(BatchRequest.claim_token).where(BatchRequest.state == RequestState.running).distinct()
    ).scalars()
    return [t for t in rows if t]


def reclaim_orphans(session: Session, *, dead_tokens: Sequence[str]) -> int:
    """Lines held by claims whose holder's heartbeat lapsed go back to pending."""
    if not dead_tokens:
        return 0
    result = session.execute(
        update(BatchRequest)
        .where(BatchRequest.state == RequestState.running, BatchRequest.claim_token.in_(list(dead_tokens)))
        .values(state=RequestState.pending, claim_token=None)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def sweep_cancelling(session: Session) -> list[str]:
    """Pending lines of cancelling batches become cancelled; returns batches ready to finish."""
    ready = []
    for batch_id in session.execute(select(Batch.id).where(Batch.status == BatchStatus.cancelling)).scalars():
        session.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.pending)
            .values(state=RequestState.cancelled, finished_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        if not _has_running(session, batch_id):
            ready.append(batch_id)
    return ready


EXPIRED_BEFORE_VALIDATION = {
    "code": "batch_expired",
    "message": "The batch expired before its input file could be validated.",
    "param": None,
    "line": None,
}


def expire_overdue(session: Session, *, now: datetime | None = None) -> list[str]:
    """Batches past expires_at: unfinished lines become batch_expired, the batch goes to finalize."""
    now = now or utcnow()
    overdue = list(
        session.execute(
            select(Batch.id).where(
                Batch.status.in_([BatchStatus.validating, BatchStatus.in_progress]), Batch.expires_at <= now
            )
        ).scalars()
    )
    for batch_id in overdue:
        # Lines first, then the batch row: the same lock order as recording a result, so an
        # expiry never deadlocks with a drain. In-flight answers arriving later fail their
        # compare-and-set and are dropped.
        session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.batch_id == batch_id,
                BatchRequest.state.in_([RequestState.pending, RequestState.running]),
            )
            .values(state=RequestState.expired, claim_token=None, finished_at=now)
            .execution_options(synchronize_session=False)
        )
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status.in_([BatchStatus.validating, BatchStatus.in_progress]))
            .values(status=BatchStatus.finalizing, expired_at=now, finalizing_at=now)
            .execution_options(synchronize_session=False)
        )
        # A batch that never got past validation has no lines to say why: say it on the batch.
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.total == 0)
            .values(errors=[EXPIRED_BEFORE_VALIDATION])
            .execution_options(synchronize_session=False)
        )
    return overdue


def _has_running(session: Session, batch_id: str) -> bool:
    return (
        session.execute(
            select(BatchRequest.line)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.state == RequestState.running)
            .limit(1)
        ).first()
        is not None
    )


def batches_to_finalize(session: Session) -> list[str]:
    """In-progress batches with nothing left to run, and batches already finalizing."""
    unfinished = (
        select(BatchRequest.line)
        .where(
            BatchRequest.batch_id == Batch.id,
            BatchRequest.state.in_([RequestState.pending, RequestState.running]),
        )
        .exists()
    )
    rows = session.execute(
        select(Batch.id).where(
            or_(
                and_(Batch.status == BatchStatus.in_progress, ~unfinished),
                Batch.status == BatchStatus.finalizing,
            )
        )
    ).scalars()
    return list(rows) + sweep_cancelling(session)


@dataclass(frozen=True)
class PendingBatch:
    """What the dispatch policy needs to know about a batch with work left."""

    batch_id: str
    team_id: str
    created_at: datetime
    expires_at: datetime
    total: int
    remaining: int  # pending or running
    remaining_tokens: int


def pending_batches(session: Session) -> list[PendingBatch]:
    """In-progress batches with work left, from their live counters: no scan of the lines."""
    rows = session.execute(
        select(Batch).where(Batch.status == BatchStatus.in_progress, Batch.total > Batch.completed + Batch.failed)
    ).scalars()
    out = []
    for b in rows:
        remaining = b.total - b.completed - b.failed
        out.append(
            PendingBatch(
                batch_id=b.id,
                team_id=b.team_id,
                created_at=b.created_at,
                expires_at=b.expires_at,
                total=b.total,
                remaining=remaining,
                remaining_tokens=b.token_estimate * remaining // max(b.total, 1),
            )
        )
    return out
