"""A group of answers is written in one statement on Postgres (one UPDATE a line on SQLite): each
line still passes its own compare-and-set, so a line given twice, a line another claim holds and a
line already recorded are each left as they were, on both databases."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.billing.ledger import set_price
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcomes
from backfill.jobs.models import Batch, BatchRequest, RequestState
from tests.factories import make_batch, make_team


def test_a_group_records_each_line_its_claim_holds_once(db: sessionmaker[Session]) -> None:
    ok = Outcome(200, b'{"id":"a"}', "req-1", Usage(10, 0, 5, 0))
    other = Outcome(200, b'{"id":"b"}', "req-2", Usage(7, 0, 3, 0))
    failed = Outcome(400, b'{"error":{}}', None, Usage(10, 0, 0, 0))
    with db.begin() as s:
        team = make_team(s)
        set_price(s, model="m", input_micros=1_000_000, cached_input_micros=0, output_micros=2_000_000)
        batch_id = make_batch(s, team, lines=4).id
        assert len(claim_requests(s, batch_id=batch_id, limit=3, claim_token="mine")) == 3
        assert len(claim_requests(s, batch_id=batch_id, limit=1, claim_token="theirs")) == 1
    with db.begin() as s:
        results = [(batch_id, 3, failed), (batch_id, 1, ok), (batch_id, 1, other), (batch_id, 2, other)]
        results.append((batch_id, 4, ok))  # held by another claim: refused
        assert record_outcomes(s, claim_token="mine", results=results) == 3
    with db.begin() as s:  # redelivered: every compare-and-set fails
        assert record_outcomes(s, claim_token="mine", results=[(batch_id, 2, other)]) == 0
    with db() as s:
        rows = {r.line: r for r in s.execute(select(BatchRequest).where(BatchRequest.batch_id == batch_id)).scalars()}
        batch = s.get(Batch, batch_id)
        assert batch is not None
    assert (rows[1].state, rows[1].response_body, rows[1].request_id) == (RequestState.succeeded, '{"id":"a"}', "req-1")
    assert (rows[2].state, rows[2].prompt_tokens, rows[2].completion_tokens) == (RequestState.succeeded, 7, 3)
    assert (rows[3].state, rows[3].status_code, rows[3].prompt_tokens) == (RequestState.failed, 400, 0)
    assert (rows[4].state, rows[4].claim_token) == (RequestState.running, "theirs")
    assert all(rows[n].claim_token is None and rows[n].finished_at is not None for n in (1, 2, 3))
    assert len({rows[n].result_id for n in (1, 2, 3)}) == 3
    assert (batch.completed, batch.failed, batch.input_tokens, batch.output_tokens) == (2, 1, 17, 8)
