"""Prices and the usage ledger.

A batch is billed at the prices in force when it was created: `create_batch` stores the price
list's version (the newest price row id) on the batch, and a request is priced with the newest
row for its model that is no newer than that version and already effective at creation time.
A completion window's own row wins over the model's general one; a window priced by the general
row pays its rates times the window's multiplier (BACKFILL_WINDOW_PRICE_MULTIPLIERS), the one in
force when the batch was created: `create_batch` stores it on the batch (`quoted_multiplier`) and
`batch_rates` bills from that, so a setting changed later, or a worker with other settings, never
bills the batch's lines at another price.

The ledger entry is written by `record_usage`, which `jobs.execution.results.record_outcomes` calls inside
the transaction that stores the request's result under a compare-and-set; the unique
(batch_id, line) constraint and an insert that ignores duplicates make a second write a no-op.
Each entry names the batch's creating key (usage by API key); its tokens and cost reach the
Prometheus counters when that transaction commits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any, cast

from sqlalchemy import Table, TextClause, bindparam, func, select, text
from sqlalchemy.orm import Session

from backfill.jobs.billing.models import LEDGER_AMOUNTS, Price, UsageLedgerEntry
from backfill.jobs.errors import InvalidRequest
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.metrics import count_usage_on_commit
from backfill.jobs.models import Batch, utcnow

log = logging.getLogger("backfill.billing")

CURRENCY = "usd"
MICROS_PER_UNIT = 1_000_000  # micro-units of currency in one unit (1 USD)
TOKENS_PER_PRICE = 1_000_000  # prices are quoted per million tokens
DEFAULT_BATCH_DISCOUNT_PERCENT = 50


@dataclass(frozen=True)
class Rates:
    """Micro-units of currency per million tokens, and the batch discount in whole percent."""

    input: int
    cached_input: int
    output: int
    discount_percent: int = DEFAULT_BATCH_DISCOUNT_PERCENT


@dataclass(frozen=True)
class Cost:
    input_micros: int = 0
    cached_input_micros: int = 0
    output_micros: int = 0

    @property
    def total_micros(self) -> int:
        return self.input_micros + self.cached_input_micros + self.output_micros


def component_cost(tokens: int, rate_per_million: int, discount_percent: int) -> int:
    """tokens x rate / 1e6 x (100 - discount) / 100, in micros, from one exact integer fraction.

    Rounding: to the nearest micro, exact halves rounded up, once per component of each request
    (never on intermediate values). The ledger stores these rounded components, so every sum
    over it (per batch, team, day, line item) is exact and a total can be re-derived by hand.
    """
    numerator = tokens * rate_per_million * (100 - discount_percent)
    denominator = TOKENS_PER_PRICE * 100
    return (numerator + denominator // 2) // denominator


def price_request(rates: Rates, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Cost:
    """Uncached input at the input rate, cached input at the cached rate, output at the output rate.

    Reasoning tokens are part of `completion_tokens` (OpenAI's accounting), so they are billed as
    output once, never added on top.
    """
    cached = min(cached_tokens, prompt_tokens)
    return Cost(
        input_micros=component_cost(prompt_tokens - cached, rates.input, rates.discount_percent),
        cached_input_micros=component_cost(cached, rates.cached_input, rates.discount_percent),
        output_micros=component_cost(completion_tokens, rates.output, rates.discount_percent),
    )


def parse_money(value: Any, *, param: str) -> int:
    """A price in currency units ("2.50", 2.5) as exact micros; more than six decimals is refused."""
    try:
        amount = Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise InvalidRequest(f"{param} must be a decimal amount, not {value!r}.", param=param) from None
    micros = amount * MICROS_PER_UNIT
    if not amount.is_finite() or amount < 0 or micros != micros.to_integral_value():
        raise InvalidRequest(f"{param} must be a non-negative amount with at most 6 decimals.", param=param)
    return int(micros)


def format_micros(micros: int) -> str:
    """Micros as a currency-unit decimal string, exactly ("1.234567")."""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS_PER_UNIT)
    return f"{sign}{whole}.{frac:06d}"


def rates_of(price: Price) -> Rates:
    return Rates(
        input=price.input_micros_per_million,
        cached_input=price.cached_input_micros_per_million,
        output=price.output_micros_per_million,
        discount_percent=price.batch_discount_percent,
    )


def scale_micros(micros: int, multiplier: Decimal) -> int:
    """micros x multiplier to the nearest micro, exact halves up (as `component_cost` rounds)."""
    scaled = Decimal(micros) * multiplier
    whole = int(scaled)  # exact: Decimal to int truncates toward zero, and scaled >= 0
    return whole + (1 if scaled - whole >= Decimal("0.5") else 0)


def quoted_multiplier(completion_window: str, multipliers: Mapping[str, Decimal]) -> Decimal:
    """The multiplier a batch created now in `completion_window` is quoted at: the window's
    (`BACKFILL_WINDOW_PRICE_MULTIPLIERS`), 1 when it has none. Stored on the batch at creation."""
    return multipliers.get(completion_window, Decimal(1))


def window_multiplier(price: Price, completion_window: str, multipliers: Mapping[str, Decimal]) -> Decimal:
    """1 for a window's own price row; for the general row (no window), the window's multiplier
    (`BACKFILL_WINDOW_PRICE_MULTIPLIERS`), 1 when it has none."""
    if price.completion_window is not None:
        return Decimal(1)
    return quoted_multiplier(completion_window, multipliers)


def scaled_rates(price: Price, multiplier: Decimal) -> Rates:
    """The row's rates times `multiplier`, each rounded to the micro once; the batch discount is
    the row's."""
    rates = rates_of(price)
    if multiplier == 1:
        return rates
    return Rates(
        input=scale_micros(rates.input, multiplier),
        cached_input=scale_micros(rates.cached_input, multiplier),
        output=scale_micros(rates.output, multiplier),
        discount_percent=rates.discount_percent,
    )


def window_rates(price: Price, completion_window: str, multipliers: Mapping[str, Decimal]) -> Rates:
    """What a batch created now in `completion_window` would be billed at (the quote), from the
    price in force for it: the row's rates times the window's multiplier in `multipliers`."""
    return scaled_rates(price, window_multiplier(price, completion_window, multipliers))


def batch_multiplier(price: Price, batch: Batch) -> Decimal:
    """The multiplier a batch's lines are billed at: 1 on the window's own price row (its rates,
    bound by the batch's price version, are the window's price); else the one stored on the batch
    when it was created, 1 for a batch older than the stored multipliers (migration 0012)."""
    if price.completion_window is not None or batch.price_multiplier is None:
        return Decimal(1)
    return batch.price_multiplier


def batch_rates(price: Price, batch: Batch) -> Rates:
    """What each request of `batch` is billed at, from the price in force for it (`price_in_force`
    at the batch's version and creation time): never the settings of the process recording it."""
    return scaled_rates(price, batch_multiplier(price, batch))


def set_price(
    session: Session,
    *,
    model: str,
    input_micros: int,
    cached_input_micros: int,
    output_micros: int,
    discount_percent: int = DEFAULT_BATCH_DISCOUNT_PERCENT,
    completion_window: str | None = None,
    effective_from: datetime | None = None,
) -> Price:
    """Append a new price version; batches created before it keep their old prices."""
    if not model:
        raise InvalidRequest("A price needs a model.", param="model")
    if not 0 <= discount_percent <= 100:
        raise InvalidRequest("The batch discount must be between 0 and 100 percent.", param="batch_discount_percent")
    for name, micros in (("input", input_micros), ("cached_input", cached_input_micros), ("output", output_micros)):
        if micros < 0:
            raise InvalidRequest(f"The {name} price cannot be negative.", param=name)
    price = Price(
        model=model,
        completion_window=completion_window or None,
        input_micros_per_million=input_micros,
        cached_input_micros_per_million=cached_input_micros,
        output_micros_per_million=output_micros,
        batch_discount_percent=discount_percent,
        effective_from=effective_from or utcnow(),
        created_at=utcnow(),
    )
    session.add(price)
    session.flush()
    return price


def list_prices(session: Session, *, model: str | None = None) -> list[Price]:
    query = select(Price).order_by(Price.model, Price.id)
    if model:
        query = query.where(Price.model == model)
    return list(session.execute(query).scalars())


def current_price_version(session: Session) -> int | None:
    """The price list's version: its newest row id (None while no price was ever set)."""
    version: int | None = session.execute(select(func.max(Price.id))).scalar_one()
    return version


def price_in_force(
    session: Session, *, model: str, completion_window: str, at: datetime, version: int | None
) -> Price | None:
    """The price for a batch: known at `version`, effective at `at`; a window-specific row wins
    over the general one, then the latest effective, then the newest version."""
    if version is None:
        return None
    return session.execute(
        select(Price)
        .where(
            Price.model == model,
            Price.id <= version,
            Price.effective_from <= at,
            (Price.completion_window == completion_window) | Price.completion_window.is_(None),
        )
        .order_by(Price.completion_window.is_(None), Price.effective_from.desc(), Price.id.desc())
        .limit(1)
    ).scalar_one_or_none()


def batch_price(session: Session, batch: Batch) -> Price | None:
    """The price a batch is billed at: its model's and window's, as in force at its creation."""
    return price_in_force(
        session,
        model=batch.model or "",
        completion_window=batch.completion_window,
        at=batch.created_at,
        version=batch.price_version,
    )


def _batch_price(session: Session, batch: Batch) -> tuple[Price, Rates] | None:
    # Price rows are append-only and the batch's version is fixed, so one lookup per batch
    # per transaction is enough (the dispatcher records results in groups of up to 200).
    cache: dict[str, tuple[Price, Rates] | None] = session.info.setdefault("billing_price_of_batch", {})
    if batch.id not in cache:
        price = batch_price(session, batch)
        if price is None:
            _warn_unpriced(batch.model or "", batch.id)
        cache[batch.id] = (price, batch_rates(price, batch)) if price else None
    return cache[batch.id]


# Models already said to have no price, in this process (bounded: a model name is the client's).
_UNPRICED_SAID: set[str] = set()
_UNPRICED_SAID_MAX = 1024


def _warn_unpriced(model: str, batch_id: str) -> None:
    """Once per model, not once per group of results (a 400-line batch with no price said it
    dozens of times)."""
    if model in _UNPRICED_SAID or len(_UNPRICED_SAID) >= _UNPRICED_SAID_MAX:
        return
    _UNPRICED_SAID.add(model)
    log.warning(
        "no price in force for model %r (first seen on batch %s): its usage is recorded at zero cost "
        "until a price is set (`backfill prices set`); not said again for this model",
        model,
        batch_id,
    )


# A batch's entries of one recorded group: the columns that differ line by line, in the order
# `_LEDGER_GROUP` unnests them; the rest (the batch's key, team, model, price, the time) are one value.
_PER_LINE = ("line", *LEDGER_AMOUNTS)
_PER_BATCH = ("batch_id", "team_id", "api_key_id", "model", "price_version", "recorded_at")


def _ledger_group_statement() -> TextClause:
    """One INSERT for a batch's entries of a group on Postgres: the per-line columns as arrays,
    unnested, so its text is the same for every group size (compiled once, prepared by the
    server) instead of an ORM bulk insert's parameter sets; a line already billed is skipped."""
    table = cast(Table, UsageLedgerEntry.__table__)
    arrays = ", ".join(f"CAST(:{name} AS {'integer' if name == 'line' else 'bigint'}[])" for name in _PER_LINE)
    columns = ", ".join([*_PER_BATCH, *_PER_LINE])
    values = ", ".join([*(f":{name}" for name in _PER_BATCH), *(f"given.{name}" for name in _PER_LINE)])
    return text(
        f"INSERT INTO usage_ledger ({columns}) SELECT {values} "
        f"FROM unnest({arrays}) AS given({', '.join(_PER_LINE)}) "
        "ON CONFLICT ON CONSTRAINT uq_usage_ledger_request DO NOTHING"
    ).bindparams(*(bindparam(name, type_=table.c[name].type) for name in _PER_BATCH))


_LEDGER_GROUP = _ledger_group_statement()


def _insert_ignoring_duplicates(session: Session, batch: dict[str, Any], lines: list[dict[str, int]]) -> None:
    """The entries `lines` (each with the `_PER_LINE` columns) of `batch` (the `_PER_BATCH` ones)."""
    if not lines:
        return
    if session.get_bind().dialect.name == "postgresql":
        session.execute(_LEDGER_GROUP, {**batch, **{name: [row[name] for row in lines] for name in _PER_LINE}})
        return
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    session.execute(
        sqlite_insert(UsageLedgerEntry).on_conflict_do_nothing(index_elements=["batch_id", "line"]),
        [{**batch, **row} for row in lines],
    )


def record_usage(session: Session, batch: Batch, results: Sequence[tuple[int, Outcome]]) -> None:
    """Ledger entries for executed requests, one per line. Failed requests (4xx, retries
    exhausted) cost nothing; cancelled and expired lines never reach `record_outcomes`."""
    priced = _batch_price(session, batch)
    price, rates = priced if priced is not None else (None, None)
    rows: list[dict[str, int]] = []
    billed: list[tuple[Usage, Cost]] = []
    for line, outcome in results:
        if not outcome.succeeded:
            continue
        usage = outcome.usage
        cost = (
            price_request(
                rates,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
                completion_tokens=usage.completion_tokens,
            )
            if rates is not None
            else Cost()
        )
        billed.append((usage, cost))
        rows.append(
            {
                "line": line,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                "completion_tokens": usage.completion_tokens,
                "reasoning_tokens": usage.reasoning_tokens,
                "input_cost_micros": cost.input_micros,
                "cached_input_cost_micros": cost.cached_input_micros,
                "output_cost_micros": cost.output_micros,
                "cost_micros": cost.total_micros,
            }
        )
    of_batch = {
        "batch_id": batch.id,
        "team_id": batch.team_id,
        "api_key_id": batch.api_key_id,
        "model": batch.model or "",
        "price_version": price.id if price is not None else None,
        "recorded_at": utcnow(),
    }
    _insert_ignoring_duplicates(session, of_batch, rows)
    if billed:
        count_usage_on_commit(
            session,
            batch,
            input_tokens=sum(u.prompt_tokens for u, _ in billed),
            cached_tokens=sum(u.cached_tokens for u, _ in billed),
            output_tokens=sum(u.completion_tokens for u, _ in billed),
            cost=sum(c.total_micros for _, c in billed) / MICROS_PER_UNIT,
        )
