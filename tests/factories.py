"""Rows the domain tests start from: a team; a batch as its create call leaves it, before
validation; and a batch with its request lines the way validation leaves them; each batch at the
price version in force."""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from backfill.jobs.billing.ledger import current_price_version
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, RequestState, Team, utcnow

CHAT = "/v1/chat/completions"


def make_team(session: Session, name: str | None = None) -> Team:
    team = Team(name=name or f"t-{secrets.token_hex(4)}")
    session.add(team)
    session.flush()
    return team


def make_submitted_batch(
    session: Session,
    team: Team | str,
    *,
    status: BatchStatus = BatchStatus.validating,
    input_file_id: str = "f",
    age_s: float = 0.0,
    expires_in_s: float = 24 * 3600,
    **columns: Any,
) -> Batch:
    """A chat batch as its create call leaves it, before validation: no model, no lines, at the
    price version in force; created `age_s` ago and expiring in `expires_in_s`. `status` and
    `columns` for the tests that need a later status only."""
    now = utcnow()
    batch = Batch(
        **{
            "team_id": team if isinstance(team, str) else team.id,
            "input_file_id": input_file_id,
            "endpoint": CHAT,
            "completion_window": "24h",
            "status": status,
            "created_at": now - timedelta(seconds=age_s),
            "expires_at": now + timedelta(seconds=expires_in_s),
            "price_version": current_price_version(session),
            **columns,
        }
    )
    session.add(batch)
    session.flush()
    return batch


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
    **columns: Any,
) -> Batch:
    """A chat batch of `lines` request lines (custom ids r1..rN), created `age_s` ago and expiring
    in `expires_in_s`; its lines in `line_state`, held by `claim_token` if given. `columns` set
    more of the batch's columns (a test that writes its own lines passes `lines=0` and `total`)."""
    batch = make_submitted_batch(
        session,
        team,
        status=status,
        input_file_id=input_file_id,
        age_s=age_s,
        expires_in_s=expires_in_s,
        **{"model": model, "total": lines, **columns},
    )
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
