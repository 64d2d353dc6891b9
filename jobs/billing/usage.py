"""Reading the usage ledger back: totals per time bucket, optionally per team, API key and model.

Aggregation happens in the database (a ledger row per request, or per minute once its batch is
rolled up: `requests` counts them); buckets are counted in whole seconds from `start`, which
callers align to the bucket width.

Usage is resolved to the minute: a rolled-up row stands at the start of its minute for every
line of that minute, so a query that ends inside a minute would count that minute's lines before
the rollup only up to its end and all of them after. Queries therefore end on a whole minute
(`resolved_end`: the end rounds up), and their totals never change when the rollup runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, cast, func, literal_column, select
from sqlalchemy.orm import Session

from backfill.jobs.billing.models import UsageLedgerEntry

BUCKET_WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
# The finest time a total can be asked for: the width of a rolled-up ledger row (jobs.billing.rollup).
RESOLUTION_S = 60
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class UsageTotals:
    bucket_start: datetime
    team_id: str | None  # None unless grouped by team
    api_key_id: str | None  # None unless grouped by key (or the entry predates recording the key)
    model: str | None  # None unless grouped by model
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    input_cost_micros: int
    cached_input_cost_micros: int
    output_cost_micros: int

    @property
    def cost_micros(self) -> int:
        return self.input_cost_micros + self.cached_input_cost_micros + self.output_cost_micros


def align(moment: datetime, width_s: int) -> datetime:
    """The start of the bucket holding `moment`, on the UTC epoch grid (days start at 00:00 UTC)."""
    seconds = int((moment - EPOCH).total_seconds())
    return EPOCH + timedelta(seconds=seconds - seconds % width_s)


def resolved_end(end: datetime) -> datetime:
    """`end` rounded up to a whole minute (unchanged when it is one): where a usage query ends."""
    floor = align(end, RESOLUTION_S)
    return floor if floor == end else floor + timedelta(seconds=RESOLUTION_S)


def epoch_seconds(session: Session) -> ColumnElement[int]:
    column = UsageLedgerEntry.recorded_at
    if session.get_bind().dialect.name == "postgresql":
        return cast(func.floor(func.extract("epoch", column)), BigInteger)
    # SQLite stores UTC wall-clock text; strftime('%s') reads it as UTC.
    return cast(func.strftime("%s", column), BigInteger)


def usage_totals(
    session: Session,
    *,
    start: datetime,
    end: datetime,
    width_s: int,
    team_ids: Sequence[str] | None = None,
    models: Sequence[str] | None = None,
    api_key_ids: Sequence[str] | None = None,
    by_team: bool = False,
    by_api_key: bool = False,
    by_model: bool = False,
) -> list[UsageTotals]:
    """Ledger sums in [start, end), one row per non-empty (bucket[, team][, key][, model]).

    `team_ids` None means every team (an admin); an empty list means none.
    """
    if team_ids is not None and not team_ids:
        return []
    start_s = int((start - EPOCH).total_seconds())
    # Integers inlined, not bound: Postgres must see the same expression in SELECT and GROUP BY.
    offset = epoch_seconds(session) - literal_column(str(start_s), BigInteger)
    bucket = (offset // literal_column(str(int(width_s)), BigInteger)).label("bucket")
    keys: list[ColumnElement[Any]] = [bucket]
    if by_team:
        keys.append(UsageLedgerEntry.team_id.expression)
    if by_api_key:
        keys.append(UsageLedgerEntry.api_key_id.expression)
    if by_model:
        keys.append(UsageLedgerEntry.model.expression)
    sums = [
        func.coalesce(func.sum(UsageLedgerEntry.requests), 0),
        func.coalesce(func.sum(UsageLedgerEntry.prompt_tokens), 0),
        func.coalesce(func.sum(UsageLedgerEntry.cached_tokens), 0),
        func.coalesce(func.sum(UsageLedgerEntry.completion_tokens), 0),
        func.coalesce(func.sum(UsageLedgerEntry.reasoning_tokens), 0),
        func.coalesce(func.sum(UsageLedgerEntry.input_cost_micros), 0),
        func.coalesce(func.sum(UsageLedgerEntry.cached_input_cost_micros), 0),
        func.coalesce(func.sum(UsageLedgerEntry.output_cost_micros), 0),
    ]
    query = select(*keys, *sums).where(UsageLedgerEntry.recorded_at >= start, UsageLedgerEntry.recorded_at < end)
    if team_ids is not None:
        query = query.where(UsageLedgerEntry.team_id.in_(list(team_ids)))
    if models:
        query = query.where(UsageLedgerEntry.model.in_(list(models)))
    if api_key_ids:
        query = query.where(UsageLedgerEntry.api_key_id.in_(list(api_key_ids)))
    query = query.group_by(*keys).order_by(*keys)
    out = []
    for row in session.execute(query).all():
        values = list(row)
        index = int(values.pop(0))
        team_id = str(values.pop(0)) if by_team else None
        key = values.pop(0) if by_api_key else None
        api_key_id = str(key) if key is not None else None
        model = str(values.pop(0)) if by_model else None
        numbers = [int(v) for v in values]
        out.append(
            UsageTotals(
                start + timedelta(seconds=index * width_s),
                team_id,
                api_key_id,
                model,
                *numbers,
            )
        )
    return out
