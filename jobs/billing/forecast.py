"""What a user needs to follow and plan a batch: what a batch has cost so far, the price a batch
created now would be billed at, the fleet's recent batch throughput and the work queued ahead,
and the completion forecast made from them.

Read by the extension routes (`api/routes/forecast.py`) and by the batch CLI, which makes its
forecast with `completion_forecast` from the numbers those routes publish. Throughput and queue
are aggregates over every team: no figure here names a team, a batch or a key.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backfill.jobs.billing.ledger import Rates, batch_price, batch_rates, current_price_version, price_in_force
from backfill.jobs.billing.models import Price, UsageLedgerEntry
from backfill.jobs.billing.usage import usage_totals
from backfill.jobs.models import Batch, BatchStatus, utcnow

DEFAULT_WINDOW_S = 300  # throughput is measured over the last five minutes unless asked otherwise
MIN_WINDOW_S, MAX_WINDOW_S = 10, 3600
BUSY_STEP_S = 10
MAX_FORECAST_S = 366 * 86400  # beyond a year a date says nothing (and could overflow a datetime)


@dataclass(frozen=True)
class CostSoFar:
    """A batch's ledger totals: what its executed requests cost (failed ones cost nothing)."""

    cost_micros: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    price: Price | None  # the price the batch is billed at; None: none was in force (billed at zero)
    rates: Rates | None  # the price's rates times the multiplier stored on the batch, as it is billed


def cost_so_far(session: Session, batch: Batch) -> CostSoFar:
    requests, prompt, cached, completion, cost = session.execute(
        select(
            func.coalesce(func.sum(UsageLedgerEntry.requests), 0),
            func.coalesce(func.sum(UsageLedgerEntry.prompt_tokens), 0),
            func.coalesce(func.sum(UsageLedgerEntry.cached_tokens), 0),
            func.coalesce(func.sum(UsageLedgerEntry.completion_tokens), 0),
            func.coalesce(func.sum(UsageLedgerEntry.cost_micros), 0),
        ).where(UsageLedgerEntry.batch_id == batch.id)
    ).one()
    price = batch_price(session, batch)
    return CostSoFar(
        cost_micros=int(cost),
        requests=int(requests),
        prompt_tokens=int(prompt),
        cached_tokens=int(cached),
        completion_tokens=int(completion),
        price=price,
        rates=batch_rates(price, batch) if price is not None else None,
    )


def price_now(session: Session, *, model: str, completion_window: str, now: datetime | None = None) -> Price | None:
    """The price a batch of `model` created now for `completion_window` would be billed at
    (`jobs.batches.create_batch` stores the current version; `jobs.billing.ledger` prices by it)."""
    return price_in_force(
        session,
        model=model,
        completion_window=completion_window,
        at=now or utcnow(),
        version=current_price_version(session),
    )


@dataclass(frozen=True)
class Throughput:
    """Batch work the fleet finished over the last `window_s` seconds, and the work still queued."""

    at: datetime
    window_s: int
    requests: int  # executed batch requests recorded in the window (every team)
    tokens: int  # their prompt + completion tokens
    busy_s: int  # the part of the window in which results were recorded, in BUSY_STEP_S steps
    queued_requests: int  # unfinished lines of in-progress batches (every team)
    queued_tokens: int  # their share of their batches' token estimates (prompt + max output)
    running_batches: int  # in-progress batches with lines left

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.window_s

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.window_s

    @property
    def busy_tokens_per_second(self) -> float:
        """The rate while the fleet had batch work: what new work can expect once it runs."""
        return self.tokens / self.busy_s if self.busy_s else 0.0

    @property
    def busy_requests_per_second(self) -> float:
        return self.requests / self.busy_s if self.busy_s else 0.0


def batch_throughput(
    session: Session, *, window_s: int = DEFAULT_WINDOW_S, model: str | None = None, now: datetime | None = None
) -> Throughput:
    """Ledger entries recorded in [now - window_s, now) (by `ix_usage_ledger_recorded`), and the
    work left in in-progress batches; both for one model when `model` is given.

    Two rates: over the whole window (a fleet that had batch work only part of it shows less
    than it can do), and over the busy part, the BUSY_STEP_S steps of the window in which any
    result was recorded (results are recorded in groups, so finer steps would count a fleet
    busy between two groups as idle).
    """
    now = now or utcnow()
    steps = usage_totals(
        session,
        start=now - timedelta(seconds=window_s),
        end=now,
        width_s=BUSY_STEP_S,
        models=[model] if model is not None else None,
    )
    # The queue as the dispatch policy sees it (`jobs.sweeps.pending_batches`): in-progress
    # batches with work left, from their live counters, never a scan of their lines.
    query = select(Batch.total, Batch.completed, Batch.failed, Batch.token_estimate).where(
        Batch.status == BatchStatus.in_progress, Batch.total > Batch.completed + Batch.failed
    )
    if model is not None:
        query = query.where(Batch.model == model)
    queued = [(t - c - f, e * (t - c - f) // max(t, 1)) for t, c, f, e in session.execute(query).all()]
    return Throughput(
        at=now,
        window_s=window_s,
        requests=sum(s.requests for s in steps),
        tokens=sum(s.prompt_tokens + s.completion_tokens for s in steps),
        busy_s=min(window_s, BUSY_STEP_S * len(steps)),
        queued_requests=sum(remaining for remaining, _ in queued),
        queued_tokens=sum(tokens for _, tokens in queued),
        running_batches=len(queued),
    )


@dataclass(frozen=True)
class Forecast:
    at: datetime | None  # when the work would be done; None: unknown
    seconds: float | None
    reason: str | None  # why the time is unknown


def completion_forecast(
    *, now: datetime, tokens: int, queued_tokens: int, tokens_per_second: float, window_s: int
) -> Forecast:
    """now + (the work queued ahead + this work) / the recent throughput (the busy rate). Every
    queued line is counted as ahead (the fair share may well start new work sooner), and the
    token counts are estimates at max output, so this errs late."""
    if tokens_per_second <= 0:
        return Forecast(
            at=None,
            seconds=None,
            reason=f"the fleet finished no batch work in the last {window_s}s (throughput 0 tok/s)",
        )
    seconds = (queued_tokens + tokens) / tokens_per_second
    if seconds > MAX_FORECAST_S:
        return Forecast(at=None, seconds=seconds, reason="more than a year at the recent throughput")
    return Forecast(at=now + timedelta(seconds=seconds), seconds=seconds, reason=None)
