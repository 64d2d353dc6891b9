"""The batch domain's metrics: tokens and cost as the ledger records them, and the cheap database
reads `/metrics` makes at scrape time (batches by status, lines of unfinished batches by state).

Tokens and cost are counted when the transaction that writes the ledger commits, never before:
a result group that rolls back (a deadlock retried, a worker killed mid-write) counts nothing,
and the ledger's compare-and-set already makes sure a line is billed, so counted, only once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from prometheus_client import Counter
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session

from backfill.jobs.models import TERMINAL_STATUSES, Batch, BatchRequest, BatchStatus, RequestState, Team
from backfill.storage.metrics import counter

# OpenAI's usage fields: input counts cached input too; output counts reasoning too.
TOKEN_KINDS = ("input", "cached_input", "output")
_PENDING = "backfill.metrics.usage"


@dataclass(frozen=True)
class UsageMetrics:
    tokens: Counter
    cost: Counter


@lru_cache
def usage_metrics() -> UsageMetrics:
    return UsageMetrics(
        tokens=counter(
            "backfill_tokens",
            "Tokens of executed batch requests, as billed (kind: input, cached_input, output).",
            ("team", "model", "kind"),
        ),
        cost=counter("backfill_cost_usd", "Cost of executed batch requests as billed, in USD.", ("team", "model")),
    )


@dataclass
class _Usage:
    input: int = 0
    cached_input: int = 0
    output: int = 0
    cost: float = 0.0


def count_usage_on_commit(
    session: Session, batch: Batch, *, input_tokens: int, cached_tokens: int, output_tokens: int, cost: float
) -> None:
    """Add a batch's newly billed usage (cost in currency units) to the counters once `session`
    commits."""
    pending: dict[tuple[str, str], _Usage] | None = session.info.get(_PENDING)
    if pending is None:
        pending = session.info[_PENDING] = defaultdict(_Usage)
    usage = pending[(_team_name(session, batch.team_id), batch.model or "")]
    usage.input += input_tokens
    usage.cached_input += cached_tokens
    usage.output += output_tokens
    usage.cost += cost


# Team names by id, for the counters' labels: a team is never renamed, and each recorded group
# would otherwise read its team's row again. Bounded: past it, names are read as before.
_TEAM_NAMES: dict[str, str] = {}
_TEAM_NAMES_MAX = 4096


def _team_name(session: Session, team_id: str) -> str:
    name = _TEAM_NAMES.get(team_id)
    if name is None:
        team = session.get(Team, team_id)
        if team is None:
            return team_id
        name = team.name
        if len(_TEAM_NAMES) < _TEAM_NAMES_MAX:
            _TEAM_NAMES[team_id] = name
    return name


# Listening on every session of the process, once: a listener added to each recording's session
# cost more than the counting (the events' registry is rebuilt per session). A session that billed
# nothing has nothing pending, so the listeners return at once.
@event.listens_for(Session, "after_commit")
def _count_pending(session: Session) -> None:
    pending: dict[tuple[str, str], _Usage] | None = session.info.get(_PENDING)
    if not pending:
        return
    metrics = usage_metrics()
    for (team, model), usage in pending.items():
        for kind in TOKEN_KINDS:
            metrics.tokens.labels(team=team, model=model, kind=kind).inc(getattr(usage, kind))
        metrics.cost.labels(team=team, model=model).inc(usage.cost)
    pending.clear()


@event.listens_for(Session, "after_rollback")
def _drop_pending(session: Session) -> None:
    pending: dict[tuple[str, str], _Usage] | None = session.info.get(_PENDING)
    if pending:
        pending.clear()


def batches_by_status(session: Session) -> dict[str, int]:
    """Every batch, counted by status (one grouped count on the status index)."""
    rows = session.execute(select(Batch.status, func.count()).group_by(Batch.status)).all()
    return {str(status): int(n) for status, n in rows}


def lines_by_state(session: Session) -> dict[str, int]:
    """Lines of the unfinished batches: succeeded and failed from the batches' live counters,
    running from the index on the lines' state (bounded by what is in flight); pending is the
    rest, cancelled or expired lines included until their batch is finalized. No line is read."""
    totals = session.execute(
        select(
            func.coalesce(func.sum(Batch.total), 0),
            func.coalesce(func.sum(Batch.completed), 0),
            func.coalesce(func.sum(Batch.failed), 0),
        ).where(Batch.status.in_([s for s in BatchStatus if s not in TERMINAL_STATUSES]))  # the status index
    ).one()
    running = session.execute(
        select(func.count()).select_from(BatchRequest).where(BatchRequest.state == RequestState.running)
    ).scalar_one()
    total, succeeded, failed = (int(v) for v in totals)
    return {
        RequestState.pending.value: max(0, total - succeeded - failed - int(running)),
        RequestState.running.value: int(running),
        RequestState.succeeded.value: succeeded,
        RequestState.failed.value: failed,
    }
