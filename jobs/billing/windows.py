"""Completion windows: which a batch may ask for, and what each costs now.

The accepted set and the multipliers come from the settings (`storage.settings` parses them);
the prices from `jobs.billing.ledger`: a window's own price row, else the model's general row times the
window's multiplier. The extension routes and the CLI show the table `window_prices` makes, so
what they show is what `jobs.billing.ledger.record_usage` bills.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Literal

from sqlalchemy.orm import Session

from backfill.jobs.billing.ledger import Rates, current_price_version, price_in_force, window_multiplier, window_rates
from backfill.jobs.billing.models import Price
from backfill.jobs.errors import InvalidRequest
from backfill.jobs.models import utcnow


def check_window(completion_window: str, windows: Mapping[str, int]) -> int:
    """The window's length in seconds; an unknown window is a 400 naming the accepted ones, in the
    words OpenAI uses for a value outside an enum."""
    if completion_window not in windows:
        supported = ", ".join(f"'{w}'" for w in windows)
        raise InvalidRequest(
            f"Invalid value: {completion_window!r}. Supported values are: {supported}.",
            param="completion_window",
            code="invalid_value",
        )
    return windows[completion_window]


@dataclass(frozen=True)
class WindowPrice:
    """What a batch of a model created now in one window is billed at."""

    completion_window: str
    seconds: int
    price: Price  # the row in force: the window's own, or the model's general one
    multiplier: Decimal  # applied to the row's rates: 1 for the window's own row
    rates: Rates  # the row's rates times the multiplier, per million tokens

    @property
    def priced_by(self) -> Literal["window", "general"]:
        return "window" if self.price.completion_window is not None else "general"


def window_price(
    session: Session,
    *,
    model: str,
    completion_window: str,
    seconds: int,
    multipliers: Mapping[str, Decimal],
    now: datetime | None = None,
    version: int | None = None,
) -> WindowPrice | None:
    """The price a batch created now would be billed at (`jobs.batches.create_batch` stores the
    current price version); None when no price is in force (its usage would cost nothing)."""
    price = price_in_force(
        session,
        model=model,
        completion_window=completion_window,
        at=now or utcnow(),
        version=version if version is not None else current_price_version(session),
    )
    if price is None:
        return None
    return WindowPrice(
        completion_window=completion_window,
        seconds=seconds,
        price=price,
        multiplier=window_multiplier(price, completion_window, multipliers),
        rates=window_rates(price, completion_window, multipliers),
    )


def window_prices(
    session: Session,
    *,
    model: str,
    windows: Mapping[str, int],
    multipliers: Mapping[str, Decimal],
    now: datetime | None = None,
) -> list[WindowPrice]:
    """Every accepted window that has a price in force, in the order of `windows` (shortest first)."""
    now, version = now or utcnow(), current_price_version(session)
    table = (
        window_price(
            session,
            model=model,
            completion_window=window,
            seconds=seconds,
            multipliers=multipliers,
            now=now,
            version=version,
        )
        for window, seconds in windows.items()
    )
    return [row for row in table if row is not None]
