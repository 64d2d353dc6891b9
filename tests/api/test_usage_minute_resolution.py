"""Usage is resolved to the minute: a finished batch's ledger is rolled up into rows stamped at
the start of their minute (jobs.billing.rollup), so a query must read whole minutes or its totals
would change when the rollup runs. Lines at 12:00:10 and 12:00:50 and a query ending 12:00:30:
the same two requests before and after the rollup (end_time rounds up to 12:01)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from backfill.api.wire import project_id_in
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.jobs.billing.rollup import roll_up_ledger
from backfill.jobs.billing.usage import usage_totals
from backfill.jobs.models import Batch, BatchStatus, Team, utcnow
from backfill.storage.db import unit_of_work
from tests.api.conftest import CheckedClient
from tests.api.conftest import Team as ApiTeam
from tests.factories import make_batch, make_team

NOON = datetime(2021, 3, 4, 12, 0, tzinfo=UTC)
LINE_TIMES = (NOON + timedelta(seconds=10), NOON + timedelta(seconds=50))
UNALIGNED_END = NOON + timedelta(seconds=30)


def _finished_batch_with_lines(session: Session, team: Team) -> str:
    batch = make_batch(session, team, lines=len(LINE_TIMES), status=BatchStatus.completed)
    batch.completed_at = utcnow()
    for line, at in enumerate(LINE_TIMES, start=1):
        session.add(
            UsageLedgerEntry(
                batch_id=batch.id,
                line=line,
                team_id=team.id,
                model="m",
                prompt_tokens=100,
                completion_tokens=10,
                input_cost_micros=7,
                output_cost_micros=3,
                cost_micros=10,
                recorded_at=at,
            )
        )
    session.flush()
    return batch.id


def _totals(session: Session, team_id: str, end: datetime) -> tuple[int, int, int]:
    rows = usage_totals(session, start=NOON, end=end, width_s=60, team_ids=[team_id])
    return (sum(r.requests for r in rows), sum(r.prompt_tokens for r in rows), sum(r.cost_micros for r in rows))


def test_rolled_up_rows_give_the_same_totals_for_an_unaligned_end(db: sessionmaker[Session]) -> None:
    from backfill.jobs.billing.usage import resolved_end

    with db.begin() as s:
        team = make_team(s, "t")
        team_id, batch_id = team.id, _finished_batch_with_lines(s, team)
    assert resolved_end(UNALIGNED_END) == NOON + timedelta(minutes=1)
    assert resolved_end(NOON) == NOON  # a whole minute stays as it is
    with db() as s:
        per_line = _totals(s, team_id, resolved_end(UNALIGNED_END))
        raw_per_line = _totals(s, team_id, UNALIGNED_END)
    with db.begin() as s:
        assert roll_up_ledger(s, batch_id, now=utcnow()) == 1
    with db() as s:
        rolled_up = _totals(s, team_id, resolved_end(UNALIGNED_END))
        raw_rolled_up = _totals(s, team_id, UNALIGNED_END)
    assert per_line == rolled_up == (2, 200, 20)
    assert (raw_per_line[0], raw_rolled_up[0]) == (1, 2)  # the seconds an unrounded end would keep


def _requests_in_usage(api: CheckedClient, team: ApiTeam) -> list[int]:
    r = api.get(
        "/v1/organization/usage/completions",
        headers=team.headers,
        params={"start_time": int(NOON.timestamp()), "end_time": int(UNALIGNED_END.timestamp()), "bucket_width": "1m"},
    )
    assert r.status_code == 200, r.text
    return [result["num_model_requests"] for bucket in r.json()["data"] for result in bucket["results"]]


def test_the_usage_api_answers_the_same_before_and_after_the_rollup(api: CheckedClient, team: ApiTeam) -> None:
    with unit_of_work() as session:
        owner = session.get(Team, project_id_in(team.project_id))
        assert owner is not None
        batch_id = _finished_batch_with_lines(session, owner)
    before = _requests_in_usage(api, team)
    with unit_of_work() as session:
        assert roll_up_ledger(session, batch_id, now=utcnow()) == 1
        assert session.get(Batch, batch_id) is not None
    after = _requests_in_usage(api, team)
    assert before == after == [2]
