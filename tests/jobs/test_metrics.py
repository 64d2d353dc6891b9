"""The domain's metrics: tokens and cost are counted when the ledger's transaction commits (never
for a rolled-back or repeated write), and the scrape-time reads count batches and lines right."""

from __future__ import annotations

import secrets

import pytest
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.billing.ledger import component_cost, set_price
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcomes
from backfill.jobs.metrics import batches_by_status, lines_by_state, usage_metrics
from backfill.jobs.models import BatchStatus
from tests.factories import make_batch, make_team


def _counted(team: str) -> tuple[float, float, float, float]:
    m = usage_metrics()
    tokens = [
        m.tokens.labels(team=team, model="m", kind=kind)._value.get() for kind in ("input", "cached_input", "output")
    ]
    return (*tokens, m.cost.labels(team=team, model="m")._value.get())


def test_tokens_and_cost_are_counted_once_the_ledger_commits(db: sessionmaker[Session]) -> None:
    name = f"metrics-{secrets.token_hex(4)}"
    ok = Outcome(200, b"{}", "req", Usage(1000, 200, 500, 0))
    with db.begin() as s:
        team = make_team(s, name)
        set_price(s, model="m", input_micros=1_000_000, cached_input_micros=500_000, output_micros=2_000_000)
        batch_id = make_batch(s, team, lines=2).id
        claim_requests(s, batch_id=batch_id, limit=2, claim_token="c")

    with pytest.raises(RuntimeError), db.begin() as s:
        record_outcomes(s, claim_token="c", results=[(batch_id, 1, ok), (batch_id, 2, ok)])
        raise RuntimeError("the task died before its commit")
    assert _counted(name) == (0, 0, 0, 0)

    with db.begin() as s:
        assert record_outcomes(s, claim_token="c", results=[(batch_id, 1, ok), (batch_id, 2, ok)]) == 2
    with db.begin() as s:  # redelivered: nothing recorded, nothing counted
        assert record_outcomes(s, claim_token="c", results=[(batch_id, 1, ok)]) == 0
    per_line = (
        component_cost(800, 1_000_000, 50) + component_cost(200, 500_000, 50) + component_cost(500, 2_000_000, 50)
    )
    assert _counted(name) == (2000, 400, 1000, pytest.approx(2 * per_line / 1_000_000))


def test_batches_by_status_and_lines_by_state(db: sessionmaker[Session]) -> None:
    ok = Outcome(200, b"{}", "req", Usage(1, 0, 1, 0))
    refused = Outcome(400, b"{}", None, Usage())
    with db.begin() as s:
        team = make_team(s)
        running = make_batch(s, team, lines=10).id
        make_batch(s, team, lines=4, status=BatchStatus.completed)  # finished: not in the line counts
        make_batch(s, team, lines=0, status=BatchStatus.validating)
        claim_requests(s, batch_id=running, limit=6, claim_token="c")
    with db.begin() as s:
        record_outcomes(s, claim_token="c", results=[(running, 1, ok), (running, 2, ok), (running, 3, refused)])
    with db() as s:
        assert batches_by_status(s) == {"in_progress": 1, "completed": 1, "validating": 1}
        assert lines_by_state(s) == {"pending": 4, "running": 3, "succeeded": 2, "failed": 1}
