"""Recording the fleet's answers: the result, the batch's counters and the ledger entry are one
write, made once, and a batch's status is a `BatchStatus` on the way in and out."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import StatementError
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.billing.ledger import component_cost, set_price
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcomes
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, RequestState, utcnow
from backfill.jobs.sweeps import batches_to_finalize, expire_overdue
from tests.factories import make_batch, make_team


def _batch(session: Session, *, lines: int, status: BatchStatus = BatchStatus.in_progress) -> str:
    """A batch of a team of its own, with a price for its model."""
    team = make_team(session)
    set_price(session, model="m", input_micros=1_000_000, cached_input_micros=0, output_micros=2_000_000)
    return make_batch(session, team, lines=lines, status=status).id


def _ledger_rows(session: Session, batch_id: str) -> int:
    return session.execute(
        select(func.count()).select_from(UsageLedgerEntry).where(UsageLedgerEntry.batch_id == batch_id)
    ).scalar_one()


def test_a_result_and_its_ledger_entry_are_one_write(db: sessionmaker[Session]) -> None:
    ok = Outcome(200, b"{}", "req", Usage(1000, 0, 500, 0))
    refused = Outcome(400, b"{}", None, Usage(1000, 0, 0, 0))
    with db.begin() as s:
        batch_id = _batch(s, lines=2)
        assert [c.line for c in claim_requests(s, batch_id=batch_id, limit=2, claim_token="c")] == [1, 2]

    # A transaction that fails after recording leaves neither the results nor the ledger entry.
    with pytest.raises(RuntimeError), db.begin() as s:
        assert record_outcomes(s, claim_token="c", results=[(batch_id, 1, ok), (batch_id, 2, refused)]) == 2
        assert _ledger_rows(s, batch_id) == 1
        raise RuntimeError("the task died before its commit")
    with db() as s:
        assert _ledger_rows(s, batch_id) == 0
        states = s.execute(select(BatchRequest.state).where(BatchRequest.batch_id == batch_id)).scalars()
        assert set(states) == {RequestState.running}

    with db.begin() as s:
        assert record_outcomes(s, claim_token="c", results=[(batch_id, 2, refused), (batch_id, 1, ok)]) == 2
    with db.begin() as s:  # redelivered: the compare-and-set fails, nothing is billed twice
        assert record_outcomes(s, claim_token="c", results=[(batch_id, 1, ok)]) == 0
    with db() as s:
        (entry,) = s.execute(select(UsageLedgerEntry).where(UsageLedgerEntry.batch_id == batch_id)).scalars()
        batch = s.get(Batch, batch_id)
        assert batch is not None
    assert (entry.line, entry.prompt_tokens, entry.completion_tokens) == (1, 1000, 500)
    assert entry.cost_micros == component_cost(1000, 1_000_000, 50) + component_cost(500, 2_000_000, 50)
    assert (batch.completed, batch.failed, batch.input_tokens, batch.output_tokens) == (1, 1, 1000, 500)


def test_batch_status_is_the_enum_and_stays_a_plain_string_column(db: sessionmaker[Session]) -> None:
    with db.begin() as s:
        batch_id = _batch(s, lines=1)
        s.execute(
            text("UPDATE batches SET expires_at = :past WHERE id = :id"),
            {"past": utcnow() - timedelta(seconds=1), "id": batch_id},
        )
    with db.begin() as s:
        assert expire_overdue(s) == [batch_id]
        assert batch_id in batches_to_finalize(s)
    with db() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None
        assert type(batch.status) is BatchStatus and batch.status is BatchStatus.finalizing
        # The column holds the bare value, as the migration's VARCHAR(16) always did.
        raw = s.execute(text("SELECT status FROM batches WHERE id = :id"), {"id": batch_id}).scalar_one()
        assert raw == "finalizing"

    # A status outside the enum never reaches the table (built by hand: no factory writes one).
    with pytest.raises(StatementError), db.begin() as s:
        s.add(
            Batch(
                team_id=batch.team_id,
                input_file_id="f",
                endpoint="/v1/chat/completions",
                completion_window="24h",
                status="finished",
                expires_at=utcnow(),
            )
        )
        s.flush()
