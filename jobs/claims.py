"""Claims on request lines: taking pending lines to run, and giving them back.

A claim is a token written on each line it holds; every write here is a compare-and-set on the
line's state and that token, so a slow worker presumed dead cannot touch lines claimed since.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from jobs.files import file_key
from jobs.models import Batch, BatchRequest, BatchStatus, RequestState, utcnow


@dataclass(frozen=True)
class ClaimedRequest:
    batch_id: str
    line: int
    custom_id: str
    offset: int
    length: int
    attempts: int
    input_key: str
    endpoint: str
    token_estimate: int


def claim_requests(
    session: Session, *, batch_id: str, limit: int, claim_token: str, now: datetime | None = None
) -> list[ClaimedRequest]:
    """Move up to `limit` pending lines of one batch to running under `claim_token`.

    Lines sharing a prompt prefix are taken together so the fleet's KV cache stays hot.
    """
    now = now or utcnow()
    batch = session.get(Batch, batch_id)
    if batch is None or batch.status != BatchStatus.in_progress or limit <= 0:
        return []

    pick = (
        select(BatchRequest.line)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.state == RequestState.pending,
            or_(BatchRequest.not_before.is_(None), BatchRequest.not_before <= now),
        )
        .order_by(BatchRequest.prefix_hash, BatchRequest.line)
        .limit(limit)
    )
    if session.get_bind().dialect.name == "postgresql":
        pick = pick.with_for_update(skip_locked=True)
    lines = list(session.execute(pick).scalars())
    if not lines:
        return []
    session.execute(
        update(BatchRequest)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.line.in_(lines),
            BatchRequest.state == RequestState.pending,
        )
        .values(state=RequestState.running, claim_token=claim_token, claimed_at=now)
        .execution_options(synchronize_session=False)
    )
    rows = session.execute(
        select(BatchRequest)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.line.in_(lines),
            BatchRequest.claim_token == claim_token,
            BatchRequest.state == RequestState.running,
        )
        .order_by(BatchRequest.line)
    ).scalars()
    key = file_key(batch.team_id, batch.input_file_id)
    return [
        ClaimedRequest(
            batch_id=batch_id,
            line=r.line,
            custom_id=r.custom_id,
            offset=r.offset,
            length=r.length,
            attempts=r.attempts,
            input_key=key,
            endpoint=batch.endpoint,
            token_estimate=r.token_estimate,
        )
        for r in rows
    ]


def release_for_retry(session: Session, *, batch_id: str, line: int, claim_token: str, not_before: datetime) -> bool:
    """Put a line back to pending after a transient failure, with a backoff time."""
    result = session.execute(
        update(BatchRequest)
        .where(
            BatchRequest.batch_id == batch_id,
            BatchRequest.line == line,
            BatchRequest.state == RequestState.running,
            BatchRequest.claim_token == claim_token,
        )
        .values(
            state=RequestState.pending,
            attempts=BatchRequest.attempts + 1,
            not_before=not_before,
            claim_token=None,
        )
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def requeue_unstarted(session: Session, *, batch_id: str, lines: Sequence[int], claim_token: str) -> None:
    """Give back claimed lines that were never sent (capacity withdrawn): no attempt spent."""
    if lines:
        session.execute(
            update(BatchRequest)
            .where(
                BatchRequest.batch_id == batch_id,
                BatchRequest.line.in_(list(lines)),
                BatchRequest.state == RequestState.running,
                BatchRequest.claim_token == claim_token,
            )
            .values(state=RequestState.pending, claim_token=None)
            .execution_options(synchronize_session=False)
        )
