"""A finished batch leaves a few rows: its ledger is rolled up per minute, key, model and price, and
its line rows go once retention's grace has passed, while every usage figure stays the same."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs.billing.forecast import CostSoFar, cost_so_far
from backfill.jobs.billing.ledger import set_price
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.jobs.billing.rollup import roll_up_ledger
from backfill.jobs.billing.usage import align, usage_totals
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcome
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, utcnow
from backfill.jobs.retention import RetentionPolicy, run_retention
from backfill.storage.objects import LocalObjectStore
from tests.factories import make_batch, make_team

LINES = 40


def _cost(c: CostSoFar) -> tuple[int, ...]:
    return (c.cost_micros, c.requests, c.prompt_tokens, c.cached_tokens, c.completion_tokens)


def _usage(s: Session, *, width_s: int) -> list[tuple[object, ...]]:
    start = align(utcnow() - timedelta(days=1), width_s)
    rows = usage_totals(s, start=start, end=utcnow() + timedelta(days=1), width_s=width_s, by_team=True, by_model=True)
    return [dataclasses.astuple(r) for r in rows]


def _finished_batch(db: sessionmaker[Session]) -> tuple[str, str]:
    with db.begin() as s:
        team = make_team(s, "t")
        set_price(s, model="m", input_micros=150_000, cached_input_micros=75_000, output_micros=600_000)
        batch = make_batch(s, team, lines=LINES)
        batch_id, team_id = batch.id, team.id
    with db.begin() as s:
        claim_requests(s, batch_id=batch_id, limit=LINES, claim_token="a")
        for line in range(1, LINES + 1):
            failed = line % 10 == 0  # a failed line costs nothing and has no ledger row
            outcome = Outcome(400 if failed else 200, b"{}", "req", Usage(100 + line, line % 7, 20 + line % 3, 0))
            assert record_outcome(s, batch_id=batch_id, line=line, claim_token="a", outcome=outcome)
    with db.begin() as s:
        done = s.get(Batch, batch_id)
        assert done is not None
        done.status = BatchStatus.completed
        done.completed_at = utcnow()
        done.output_file_id = "out"
    return batch_id, team_id


def test_rollup_keeps_every_usage_figure_and_leaves_a_few_rows(db: sessionmaker[Session]) -> None:
    batch_id, _ = _finished_batch(db)
    with db() as s:
        before = {w: _usage(s, width_s=w) for w in (60, 3600, 86400)}
        batch = s.get(Batch, batch_id)
        assert batch is not None
        cost_before = _cost(cost_so_far(s, batch))
        assert s.execute(select(func.count()).select_from(UsageLedgerEntry)).scalar_one() == LINES - LINES // 10
    with db.begin() as s:
        assert roll_up_ledger(s, batch_id, now=utcnow()) == 1
    with db.begin() as s:  # a second run (a retry, another replica) changes nothing
        assert roll_up_ledger(s, batch_id, now=utcnow()) == 0
    with db() as s:
        rows = s.execute(select(UsageLedgerEntry)).scalars().all()
        assert 1 <= len(rows) <= 2  # one per minute the lines were recorded in
        assert all(r.line < 0 for r in rows)
        assert sum(r.requests for r in rows) == LINES - LINES // 10
        assert {w: _usage(s, width_s=w) for w in (60, 3600, 86400)} == before
        batch = s.get(Batch, batch_id)
        assert batch is not None
        assert _cost(cost_so_far(s, batch)) == cost_before


def test_retention_removes_the_line_rows_and_rolls_up_the_ledger(db: sessionmaker[Session], tmp_path: Path) -> None:
    batch_id, _ = _finished_batch(db)
    store = LocalObjectStore(tmp_path / "objects")
    policy = RetentionPolicy(orphan_grace_s=3600, result_body_grace_s=3600)
    # the batch just ended: its lines and ledger rows stay for the grace period
    report = run_retention(db.begin, store, policy=policy)
    assert (report.ledgers, report.body_batches) == (0, 0)
    with db() as s:
        assert s.execute(select(func.count()).where(BatchRequest.batch_id == batch_id)).scalar_one() == LINES
    report = run_retention(db.begin, store, policy=policy, now=utcnow() + timedelta(hours=2))
    assert (report.ledgers, report.body_batches) == (1, 1)
    with db() as s:
        assert s.execute(select(func.count()).where(BatchRequest.batch_id == batch_id)).scalar_one() == 0
        assert s.execute(select(func.count()).select_from(UsageLedgerEntry)).scalar_one() <= 2
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.bodies_purged_at is not None
        assert (batch.completed, batch.failed) == (LINES - LINES // 10, LINES // 10)  # the counters stay


def test_a_batch_whose_bodies_the_old_code_purged_is_retired_too(db: sessionmaker[Session], tmp_path: Path) -> None:
    """Before retirement became one step, a batch could be marked `bodies_purged_at` with its line
    rows still there (or its ledger not rolled up): it is selected by its ledger, not by that mark."""
    batch_id, _ = _finished_batch(db)
    with db.begin() as s:
        s.execute(update(Batch).where(Batch.id == batch_id).values(bodies_purged_at=utcnow()))
    store = LocalObjectStore(tmp_path / "objects")
    policy = RetentionPolicy(orphan_grace_s=3600, result_body_grace_s=3600)
    run_retention(db.begin, store, policy=policy, now=utcnow() + timedelta(hours=2))
    with db() as s:
        assert s.execute(select(func.count()).where(BatchRequest.batch_id == batch_id)).scalar_one() == 0
        assert all(r.line < 0 for r in s.execute(select(UsageLedgerEntry)).scalars())
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.ledger_rolled_up_at is not None


def test_a_retention_pass_retires_a_few_batches_each_in_its_own_transaction(
    db: sessionmaker[Session], tmp_path: Path
) -> None:
    """The first pass after an upgrade finds every batch ever finished: a pass retires at most
    `batches_per_pass` of them, the next pass the next ones."""
    with db.begin() as s:
        team = make_team(s, "t")
        for _ in range(5):
            batch = make_batch(s, team, lines=2, status=BatchStatus.completed)
            batch.completed_at, batch.output_file_id = utcnow(), "out"
    store = LocalObjectStore(tmp_path / "objects")
    policy = RetentionPolicy(orphan_grace_s=3600, result_body_grace_s=3600, batches_per_pass=2)
    transactions: list[Session] = []

    @contextmanager
    def counted() -> Iterator[Session]:
        with db.begin() as s:
            transactions.append(s)
            yield s

    later = utcnow() + timedelta(hours=2)
    passes = [run_retention(counted, store, policy=policy, now=later) for _ in range(4)]
    assert [(p.retired, p.body_batches, p.ledgers) for p in passes] == [(2, 2, 2), (2, 2, 2), (1, 1, 1), (0, 0, 0)]
    # Per pass: one to list the batches, one per batch retired, one to list the files to purge
    # and one to find uploads to clean up (none here; the empty store has no orphans to look up).
    assert len(transactions) == (1 + 2 + 2) + (1 + 2 + 2) + (1 + 1 + 2) + (1 + 0 + 2)
    with db() as s:
        assert s.execute(select(func.count()).select_from(BatchRequest)).scalar_one() == 0
        assert s.execute(select(func.count()).where(Batch.ledger_rolled_up_at.is_(None))).scalar_one() == 0
