"""Rolling up a finished batch's ledger: one row per minute, key, model and price, not per line.

While a batch runs, every billed line has its own ledger row: the unique (batch, line) pair is
what makes billing idempotent when a result is recorded twice. Once the batch is terminal no line
of it can be billed again (recording needs the line still `running` under its claim), so the rows
can be summed into a few, and the ledger grows with batches and minutes instead of lines served.

Usage buckets are whole minutes at the finest (`jobs.billing.usage`), aligned to the epoch, so a row at
the start of its minute falls in every bucket its lines fell in: the sums do not change.
Rollup rows take negative line numbers, leaving the line space to the per-line rows.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, delete, func, insert, literal_column, select, update
from sqlalchemy.orm import Session

from backfill.jobs.billing.models import LEDGER_AMOUNTS, UsageLedgerEntry
from backfill.jobs.billing.usage import EPOCH, epoch_seconds
from backfill.jobs.models import Batch

ROLLUP_S = 60


def roll_up_ledger(session: Session, batch_id: str, *, now: datetime) -> int:
    """Replace the batch's per-line ledger rows by their sums per minute, key, model and price.
    The compare-and-set on `ledger_rolled_up_at` makes a second run (another replica, a retry)
    change nothing; rollup and deletion commit together, so the totals never count twice."""
    claimed = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.ledger_rolled_up_at.is_(None))
        .values(ledger_rolled_up_at=now)
        .execution_options(synchronize_session=False)
    )
    if claimed.rowcount != 1:  # type: ignore[attr-defined]
        return 0
    row = UsageLedgerEntry
    minute = (epoch_seconds(session) // literal_column(str(ROLLUP_S), BigInteger)).label("minute")
    keys = [minute, row.team_id, row.api_key_id, row.model, row.price_version]
    sums = [
        func.sum(row.requests),
        func.sum(row.prompt_tokens),
        func.sum(row.cached_tokens),
        func.sum(row.completion_tokens),
        func.sum(row.reasoning_tokens),
        func.sum(row.input_cost_micros),
        func.sum(row.cached_input_cost_micros),
        func.sum(row.output_cost_micros),
        func.sum(row.cost_micros),
    ]
    per_line = (row.batch_id == batch_id, row.line >= 0)
    groups = session.execute(select(*keys, *sums).where(*per_line).group_by(*keys).order_by(*keys)).all()
    if not groups:
        return 1
    names = ["requests", *LEDGER_AMOUNTS]
    rows: list[dict[str, Any]] = []
    for i, group in enumerate(groups):
        values: list[Any] = list(group)
        minute_index, team_id, api_key_id, model, price_version = values[:5]
        totals = values[5:]
        rows.append(
            {
                "batch_id": batch_id,
                "line": -(i + 1),
                "team_id": team_id,
                "api_key_id": api_key_id,
                "model": model,
                "price_version": price_version,
                "recorded_at": EPOCH + timedelta(seconds=int(minute_index) * ROLLUP_S),
                **{name: int(value or 0) for name, value in zip(names, totals, strict=True)},
            }
        )
    session.execute(delete(row).where(*per_line).execution_options(synchronize_session=False))
    session.execute(insert(row), rows)
    return 1
