"""Usage by API key: a batch remembers the key that created it, every ledger entry of the batch
names that key, and the ledger sums group and filter by it (OpenAI's `group_by=api_key_id`)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.batches import create_batch
from backfill.jobs.billing.ledger import component_cost, set_price
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.jobs.billing.usage import usage_totals
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcomes
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, File, Team, utcnow
from backfill.jobs.teams import create_key
from backfill.storage.settings import get_settings
from tests.factories import make_team

WINDOWS = {"24h": 24 * 3600}


def _batch_by(session: Session, team: Team, key_id: str, *, lines: int) -> str:
    source = File(team_id=team.id, purpose="batch", filename="in.jsonl", bytes=1, object_key="k")
    session.add(source)
    session.flush()
    batch = create_batch(
        session,
        team_id=team.id,
        input_file_id=source.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        windows=WINDOWS,
        multipliers=get_settings().window_price_multipliers,
        api_key_id=key_id,
    )
    # What validation does, in short: the lines, the model, in progress.
    session.execute(
        update(Batch)
        .where(Batch.id == batch.id)
        .values(status=BatchStatus.in_progress, model="m", total=lines)
        .execution_options(synchronize_session=False)
    )
    for line in range(1, lines + 1):
        session.add(BatchRequest(batch_id=batch.id, line=line, custom_id=f"r{line}", offset=0, length=1))
    session.flush()
    return batch.id


def _run(session: Session, batch_id: str, lines: int, usage: Usage) -> None:
    claimed = claim_requests(session, batch_id=batch_id, limit=lines, claim_token=f"c-{batch_id}")
    ok = Outcome(200, b"{}", "req", usage)
    assert record_outcomes(session, claim_token=f"c-{batch_id}", results=[(batch_id, c.line, ok) for c in claimed])


def test_the_ledger_records_the_creating_key_and_sums_by_it(db: sessionmaker[Session]) -> None:
    with db.begin() as s:
        team = make_team(s, "keys")
        set_price(s, model="m", input_micros=2_000_000, cached_input_micros=0, output_micros=4_000_000)
        first, _ = create_key(s, team_id=team.id, name="pipeline")
        second, _ = create_key(s, team_id=team.id, name="evals")
        a = _batch_by(s, team, first.id, lines=3)
        b = _batch_by(s, team, second.id, lines=2)
        created = s.get(Batch, a)
        assert created is not None and created.api_key_id == first.id
    with db.begin() as s:
        _run(s, a, 3, Usage(100, 0, 10, 0))
        _run(s, b, 2, Usage(1000, 0, 100, 0))

    with db() as s:
        entries = s.execute(select(UsageLedgerEntry.batch_id, UsageLedgerEntry.api_key_id)).all()
        assert sorted(entries) == sorted([(a, first.id)] * 3 + [(b, second.id)] * 2)

        start = utcnow() - timedelta(hours=1)
        end = utcnow() + timedelta(hours=1)
        rows = usage_totals(s, start=start, end=end, width_s=7200, by_api_key=True)
        by_key = {r.api_key_id: (r.requests, r.prompt_tokens, r.completion_tokens) for r in rows}
        assert by_key == {first.id: (3, 300, 30), second.id: (2, 2000, 200)}
        # Costs follow the key too: 300 input tokens at $2/M, 30 output at $4/M, half off.
        cost = {r.api_key_id: r.cost_micros for r in rows}
        assert cost[first.id] == component_cost(300, 2_000_000, 50) + component_cost(30, 4_000_000, 50)

        only = usage_totals(s, start=start, end=end, width_s=7200, api_key_ids=[second.id])
        assert [(r.requests, r.api_key_id) for r in only] == [(2, None)]  # filtered, not grouped
