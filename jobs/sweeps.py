"""Sweeps the scheduler loop runs over all batches: expiry, cancellation, reclaiming lines whose
worker died, finding the batches to finalize or to dispatch, and a census of a stalled batch.

Each is idempotent and a compare-and-set on states, so two schedulers are merely wasteful.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from backfill.jobs.errors import batch_error
from backfill.jobs.execution.results import attempts_exceeded, record_outcomes
from backfill.jobs.models import (
    RUNNING_LINES,
    TERMINAL_STATUSES,
    Batch,
    BatchRequest,
    BatchStatus,
    RequestState,
    utcnow,
)


def running_claim_tokens(session: Session) -> list[str]:
    rows = session.execute(select(BatchRequest.claim_token).where(RUNNING_LINES).distinct()).scalars()
    return [t for t in rows if t]


def lines_held_by(session: Session, claim_token: str) -> dict[str, list[int]]:
    """The running lines a claim holds, by batch."""
    out: dict[str, list[int]] = {}
    rows = session.execute(
        select(BatchRequest.batch_id, BatchRequest.line).where(RUNNING_LINES, BatchRequest.claim_token == claim_token)
    )
    for batch_id, line in rows:
        out.setdefault(batch_id, []).append(line)
    return out


@dataclass
class Reclaimed:
    """Lines taken back from lapsed holders, per batch."""

    requeued: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)  # past the attempt cap: error file

    @property
    def total(self) -> int:
        return sum(self.requeued.values()) + sum(self.failed.values())


def reclaim_orphans(session: Session, *, dead_tokens: Sequence[str], max_attempts: int) -> Reclaimed:
    """Lines held by claims whose holder's heartbeat lapsed: the try they were on counts as an
    attempt (a line that crashes its worker must not come back forever); lines with attempts
    left go back to pending, the others fail with `max_attempts_exceeded`."""
    out = Reclaimed()
    if not dead_tokens:
        return out
    held = and_(RUNNING_LINES, BatchRequest.claim_token.in_(list(dead_tokens)))
    exhausted = session.execute(
        select(BatchRequest.claim_token, BatchRequest.batch_id, BatchRequest.line, BatchRequest.attempts).where(
            held, BatchRequest.attempts + 1 >= max_attempts
        )
    ).all()
    failed_here: list[tuple[str, int]] = []
    for token, batch_id, line, attempts in exhausted:
        assert token is not None  # (selected by its token)
        why = "the worker running it stopped each time, or its result could not be recorded"
        if record_outcomes(
            session, claim_token=token, results=[(batch_id, line, attempts_exceeded(attempts + 1, why))]
        ):
            out.failed[batch_id] += 1
            failed_here.append((batch_id, line))
    if failed_here:  # the try that ran out counts too: on the lines this reclaim failed, and only those
        # (another reclaim at once, or the drain's own answer, may have ended a line read above)
        session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.state == RequestState.failed,
                or_(*(and_(BatchRequest.batch_id == b, BatchRequest.line == n) for b, n in failed_here)),
            )
            .values(attempts=BatchRequest.attempts + 1)
            .execution_options(synchronize_session=False)
        )
    requeued = session.execute(
        update(BatchRequest)
        .where(held)
        .values(state=RequestState.pending, claim_token=None, attempts=BatchRequest.attempts + 1)
        .returning(BatchRequest.batch_id)
        .execution_options(synchronize_session=False)
    ).scalars()
    out.requeued.update(requeued)
    return out


@dataclass(frozen=True)
class LineCensus:
    """Where the unfinished lines of one batch stand."""

    ready: int  # pending, may be claimed now
    backing_off: int  # pending, not before a retry time
    running: int
    holders: frozenset[str]  # claim tokens on its running lines


def line_census(session: Session, batch_id: str, *, now: datetime | None = None) -> LineCensus:
    now = now or utcnow()
    due = or_(BatchRequest.not_before.is_(None), BatchRequest.not_before <= now)
    pending = BatchRequest.state == RequestState.pending
    running = BatchRequest.state == RequestState.running
    of_batch = BatchRequest.batch_id == batch_id
    ready, backing_off, n_running = session.execute(
        select(
            func.count().filter(pending, due),
            func.count().filter(pending, ~due),
            func.count().filter(running),
        ).where(of_batch, or_(pending, running))
    ).one()
    holders = session.execute(
        select(BatchRequest.claim_token).where(of_batch, running, BatchRequest.claim_token.is_not(None)).distinct()
    ).scalars()
    return LineCensus(
        ready=int(ready),
        backing_off=int(backing_off),
        running=int(n_running),
        holders=frozenset(h for h in holders if h),
    )


def sweep_cancelling(session: Session) -> list[str]:
    """Cancelling batches with nothing left running: ready to finish. Their pending lines stay
    as they are (no claim takes a line of a batch that is not in progress) and finalization
    writes them as cancelled (`jobs.output.finalize`): a cancel costs no write per line."""
    return _settled(session, BatchStatus.cancelling)


def _settled(session: Session, status: BatchStatus) -> list[str]:
    """Batches in `status`, with all their lines indexed, and none running."""
    batch_ids = session.execute(select(Batch.id).where(Batch.status == status, INDEXED)).scalars()
    return [batch_id for batch_id in batch_ids if not has_running(session, batch_id)]


def settled(session: Session, batch_ids: Sequence[str], *, status: BatchStatus) -> list[str]:
    """Those of `batch_ids` in `status`, with all their lines indexed, and none running."""
    in_status = session.execute(
        select(Batch.id).where(Batch.id.in_(batch_ids), Batch.status == status, INDEXED)
    ).scalars()
    return [batch_id for batch_id in in_status if not has_running(session, batch_id)]


EXPIRED_BEFORE_VALIDATION = batch_error("batch_expired", "The batch expired before its input file could be validated.")


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
    for batch_id in sorted(overdue):  # in id order, as drains record results across batches
        # The batch row first, FOR UPDATE: it waits for the claims in flight on the batch
        # (each holds FOR KEY SHARE on it, `jobs.execution.claims`) and keeps new ones out until this
        # commits, when they find the batch no longer in progress. So every running line is
        # here to be seen, and none is claimed after. Those running become expired (their
        # answers, arriving later, fail their compare-and-set and are dropped), skipping any
        # a drain is recording right now: it finishes it (and then waits for this row). No
        # wait on a line, so no deadlock with a drain (lines, then batch rows, in id order).
        # Pending lines stay as they are and finalization writes them as expired: expiring a
        # million-line batch is not a million-row update.
        session.execute(select(Batch.id).where(Batch.id == batch_id).with_for_update())
        moved = session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status.in_([BatchStatus.validating, BatchStatus.in_progress]))
            .values(status=BatchStatus.finalizing, expired_at=now, finalizing_at=now)
            .execution_options(synchronize_session=False)
        )
        if not moved.rowcount:  # type: ignore[attr-defined]
            continue  # it moved on meanwhile (completed, cancelled)
        running = (
            select(BatchRequest.line)
            .where(RUNNING_LINES, BatchRequest.batch_id == batch_id)
            .with_for_update(skip_locked=True)
        )
        session.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.line.in_(running.scalar_subquery()), RUNNING_LINES)
            .values(state=RequestState.expired, claim_token=None, finished_at=now)
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


# Every line of the batch has its index row (validation writes a large index in parts).
INDEXED = Batch.unindexed == 0


def indexing_batches(session: Session, *, started_before: datetime) -> list[str]:
    """Unfinished batches whose index is still being written, validated before `started_before`:
    if the validation writing it stopped, the next one (nudged by the scheduler loop) resumes."""
    return list(
        session.execute(
            select(Batch.id).where(
                Batch.unindexed > 0,
                Batch.status.not_in(TERMINAL_STATUSES),
                # (A batch cancelled while it was validating never went in progress.)
                func.coalesce(Batch.in_progress_at, Batch.created_at) < started_before,
            )
        ).scalars()
    )


def has_running(session: Session, batch_id: str) -> bool:
    """Whether a line of the batch is running (through the running-lines partial index)."""
    return (
        session.execute(
            select(BatchRequest.line).where(RUNNING_LINES, BatchRequest.batch_id == batch_id).limit(1)
        ).first()
        is not None
    )


def batches_to_finalize(session: Session) -> list[str]:
    """In-progress batches with nothing left to run, and batches already finalizing whose lines
    all settled. A batch that expired while a drain was recording one of its lines waits for
    that line: a nudge spent before it settles finds nothing to do, and the next would come
    only a re-nudge interval later (`scheduler.ticker.RENUDGE_S`)."""
    unfinished = (
        select(BatchRequest.line)
        .where(
            BatchRequest.batch_id == Batch.id,
            BatchRequest.state.in_([RequestState.pending, RequestState.running]),
        )
        .exists()
    )
    ready = session.execute(
        select(Batch.id).where(Batch.status == BatchStatus.in_progress, INDEXED, ~unfinished)
    ).scalars()
    return [*ready, *_settled(session, BatchStatus.finalizing), *sweep_cancelling(session)]


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
    model: str | None = None  # the one model its lines name (None: not recorded)


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
                model=b.model,
            )
        )
    return out
