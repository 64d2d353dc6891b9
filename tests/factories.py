"""Rows the domain tests start from, built the way validation leaves them: a team, and a batch of
a team with its request lines, at the price version in force."""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from backfill.jobs.billing.ledger import current_price_version
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, RequestState, Team, utcnow


def make_team(session: Session, name: str | None = None) -> Team:
    team = Team(name=name or f"t-{secrets.token_hex(4)}")
    session.add(team)
    session.flush()
    return team


def make_batch(
    session: Session,
    team: Team | str,
    *,
    lines: int,
    model: str = "m",
    status: BatchStatus = BatchStatus.in_progress,
    input_file_id: str = "f",
    age_s: float = 0.0,
    expires_in_s: float = 24 * 3600,
    line_state: RequestState = RequestState.pending,
    claim_token: str | None = None,
    attempts: int = 0,
) -> Batch:
    """A chat batch of `lines` request lines (custom ids r1..rN), created `age_s` ago and expiring
    in `expires_in_s`; its lines in `line_state`, held by `claim_token` if given."""
    now = utcnow()
    batch = Batch(
        team_id=team if isinstance(team, str) else team.id,
        input_file_id=input_file_id,
        endpoint="/v1/chat/completions",
        model=model,
        completion_window="24h",
        status=status,
        created_at=now - timedelta(seconds=age_s),
        expires_at=now + timedelta(seconds=expires_in_s),
        total=lines,
        price_version=current_price_version(session),
    )
    session.add(batch)
    session.flush()
    for line in range(1, lines + 1):
        session.add(
            BatchRequest(
                batch_id=batch.id,
                line=line,
                custom_id=f"r{line}",
                offset=0,
                length=1,
                state=line_state,
                claim_token=claim_token,
                attempts=attempts,
            )
        )
    session.flush()
    return batch


def formatter_rows(session: Session, batch_id: str) -> list[Any]:
    """A batch's lines, in line order, with the columns the output formatter reads."""
    return list(
        session.execute(
            select(
                BatchRequest.line,
                BatchRequest.result_id,
                BatchRequest.custom_id,
                BatchRequest.state,
                BatchRequest.status_code,
                BatchRequest.request_id,
                BatchRequest.response_body,
            )
            .where(BatchRequest.batch_id == batch_id)
            .order_by(BatchRequest.line)
        ).all()
    )
