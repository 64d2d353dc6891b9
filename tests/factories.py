"""Rows the domain tests start from, built the way validation leaves them: a batch of a team
with its request lines, at the price version in force."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session

from backfill.jobs.billing.ledger import current_price_version
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, Team, utcnow


def make_batch(
    session: Session,
    team: Team,
    *,
    lines: int,
    model: str = "m",
    status: BatchStatus = BatchStatus.in_progress,
) -> Batch:
    """A chat batch of `lines` request lines (custom ids r1..rN), expiring in 24 h."""
    now = utcnow()
    batch = Batch(
        team_id=team.id,
        input_file_id="f",
        endpoint="/v1/chat/completions",
        model=model,
        completion_window="24h",
        status=status,
        created_at=now,
        expires_at=now + timedelta(hours=24),
        total=lines,
        price_version=current_price_version(session),
    )
    session.add(batch)
    session.flush()
    for line in range(1, lines + 1):
        session.add(BatchRequest(batch_id=batch.id, line=line, custom_id=f"r{line}", offset=0, length=1))
    session.flush()
    return batch
