"""The usage ledger, prices in force, quotas and usage buckets, on a migrated SQLite file and a
migrated scratch Postgres database (never the one a running stack uses)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.billing.ledger import component_cost, current_price_version, price_in_force, record_usage, set_price
from backfill.jobs.billing.models import Price, UsageLedgerEntry
from backfill.jobs.billing.quotas import quota_errors, set_quota
from backfill.jobs.billing.usage import align, usage_totals
from backfill.jobs.execution.claims import claim_requests, release_for_retry
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcome
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, utcnow
from backfill.jobs.validation.outcome import apply_validation
from backfill.jobs.validation.scan import ValidationResult
from tests.factories import make_batch, make_team

PG_ADMIN_URL = os.environ.get("TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def _price(session: Session, model: str, **extra: Any) -> Price:
    """$0.15 input, $0.075 cached input, $0.60 output per million tokens."""
    return set_price(
        session, model=model, input_micros=150_000, cached_input_micros=75_000, output_micros=600_000, **extra
    )


def _ok(prompt: int, cached: int, completion: int) -> Outcome:
    return Outcome(200, b"{}", "req", Usage(prompt, cached, completion, 0))


def test_each_request_is_billed_once_at_the_price_of_its_batch(db: sessionmaker[Session]) -> None:
    with db.begin() as s:
        team = make_team(s, "t")
        v1 = _price(s, "m")
        batch_id = make_batch(s, team, lines=3).id
        # A new price after the batch was created does not touch it.
        set_price(s, model="m", input_micros=9_000_000, cached_input_micros=9_000_000, output_micros=9_000_000)
    with db.begin() as s:
        assert [c.line for c in claim_requests(s, batch_id=batch_id, limit=3, claim_token="a")] == [1, 2, 3]
        # Line 2: a transient failure, put back for a retry (the forced retry).
        assert release_for_retry(s, batch_id=batch_id, line=2, claim_token="a", not_before=utcnow())
        assert record_outcome(s, batch_id=batch_id, line=1, claim_token="a", outcome=_ok(4077, 4032, 4))
        # Line 3: the fleet's 4xx costs nothing.
        assert record_outcome(
            s, batch_id=batch_id, line=3, claim_token="a", outcome=Outcome(400, b"{}", None, Usage(50, 0, 0, 0))
        )
    with db.begin() as s:
        # A redelivered result for line 1 fails its compare-and-set: nothing more is billed.
        assert not record_outcome(s, batch_id=batch_id, line=1, claim_token="a", outcome=_ok(4077, 4032, 4))
        assert [c.line for c in claim_requests(s, batch_id=batch_id, limit=3, claim_token="b")] == [2]
        # The first holder's late answer for the retried line is dropped; the new holder's counts.
        assert not record_outcome(s, batch_id=batch_id, line=2, claim_token="a", outcome=_ok(100, 0, 5))
        assert record_outcome(s, batch_id=batch_id, line=2, claim_token="b", outcome=_ok(100, 0, 5))
    with db.begin() as s:
        # Even the ledger write itself run twice cannot write a second row: the unique constraint holds.
        batch = s.get(Batch, batch_id)
        assert batch is not None
        record_usage(s, batch, [(1, _ok(4077, 4032, 4))])
    with db() as s:
        rows = {r.line: r for r in s.execute(select(UsageLedgerEntry)).scalars()}
        batch = s.get(Batch, batch_id)
        assert batch is not None
    assert sorted(rows) == [1, 2]
    assert {r.price_version for r in rows.values()} == {v1.id}
    assert (rows[1].input_cost_micros, rows[1].cached_input_cost_micros, rows[1].output_cost_micros) == (3, 151, 1)
    assert rows[1].cost_micros == 155
    assert rows[2].cost_micros == component_cost(100, 150_000, 50) + component_cost(5, 600_000, 50)
    # The batch's live usage is the sum of its ledger entries.
    assert batch.input_tokens == sum(r.prompt_tokens for r in rows.values()) == 4177
    assert batch.cached_tokens == sum(r.cached_tokens for r in rows.values()) == 4032
    assert batch.output_tokens == sum(r.completion_tokens for r in rows.values()) == 9
    assert (batch.completed, batch.failed) == (2, 1)


def test_price_in_force(db: sessionmaker[Session]) -> None:
    with db.begin() as s:
        general = _price(s, "m")
        week = _price(s, "m", completion_window="7d", discount_percent=60)
        later = _price(s, "m", effective_from=utcnow() + timedelta(days=1))
        _price(s, "other")
        version = current_price_version(s)
        now = utcnow()

        def pick(window: str, at: object = now, v: int | None = version) -> int | None:
            price = price_in_force(s, model="m", completion_window=window, at=at, version=v)  # type: ignore[arg-type]
            return price.id if price else None

        assert pick("24h") == general.id
        assert pick("7d") == week.id  # a window's own price beats the general one
        assert pick("24h", now + timedelta(days=2)) == later.id  # future-dated prices wait their turn
        assert pick("24h", v=general.id - 1) is None  # nothing was priced at that version
        assert pick("24h", v=None) is None


def test_quota_fails_validation_with_the_numbers(db: sessionmaker[Session]) -> None:
    with db.begin() as s:
        team = make_team(s, "q")
        running = make_batch(s, team, lines=1)
        running.token_estimate = 600
        make_batch(s, team, lines=1, model="other").token_estimate = 10_000  # another model: not counted
        set_quota(s, team_id=team.id, model="m", max_enqueued_tokens=1000, max_concurrent_batches=None)
        new = make_batch(s, team, lines=0, status=BatchStatus.validating)
        new_id, team_id = new.id, team.id
    result = ValidationResult(
        model="m",
        token_estimate=500,
        requests=[{"line": 1, "custom_id": "x", "offset": 0, "length": 1, "prefix_hash": "", "token_estimate": 500}],
    )
    with db.begin() as s:
        assert apply_validation(s, batch_id=new_id, result=result) == BatchStatus.failed
    with db() as s:
        batch = s.get(Batch, new_id)
        assert batch is not None and batch.errors is not None
        (error,) = batch.errors
        assert error["code"] == "token_limit_exceeded"
        for number in ("500", "600", "1100", "1000"):
            assert number in error["message"]
        assert s.execute(select(func.count()).where(BatchRequest.batch_id == new_id)).scalar_one() == 0
    with db.begin() as s:
        set_quota(s, team_id=team_id, model="m", max_enqueued_tokens=None, max_concurrent_batches=1)
        errors = quota_errors(s, team_id=team_id, model="m", batch_id="new", token_estimate=1)
        assert [e["code"] for e in errors] == ["token_limit_exceeded"] and "limit is 1" in errors[0]["message"]
        set_quota(s, team_id=team_id, model="m", max_enqueued_tokens=1100, max_concurrent_batches=2)
        assert quota_errors(s, team_id=team_id, model="m", batch_id="new", token_estimate=500) == []


def test_usage_buckets(db: sessionmaker[Session]) -> None:
    day = align(utcnow(), 86400) - timedelta(days=1)
    with db.begin() as s:
        team = make_team(s, "u")
        batch = make_batch(s, team, lines=0)
        for line, (offset_s, model) in enumerate([(0, "m"), (3599, "m"), (3600, "m"), (7300, "x")], start=1):
            s.add(
                UsageLedgerEntry(
                    batch_id=batch.id,
                    line=line,
                    team_id=team.id,
                    model=model,
                    prompt_tokens=10 * line,
                    cached_tokens=line,
                    completion_tokens=2,
                    cost_micros=7,
                    input_cost_micros=7,
                    recorded_at=day + timedelta(seconds=offset_s),
                )
            )
    with db() as s:
        hourly = usage_totals(s, start=day, end=day + timedelta(days=1), width_s=3600, by_model=True)
        assert [(r.bucket_start - day, r.model, r.requests, r.prompt_tokens) for r in hourly] == [
            (timedelta(0), "m", 2, 30),
            (timedelta(hours=1), "m", 1, 30),
            (timedelta(hours=2), "x", 1, 40),
        ]
        (daily,) = usage_totals(s, start=day, end=day + timedelta(days=1), width_s=86400, team_ids=[team.id])
        assert (daily.requests, daily.cached_tokens, daily.cost_micros) == (4, 10, 28)
        assert usage_totals(s, start=day, end=day + timedelta(days=1), width_s=86400, team_ids=["nobody"]) == []
        assert usage_totals(s, start=day, end=day + timedelta(days=1), width_s=86400, team_ids=[]) == []
