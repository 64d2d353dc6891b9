"""`backfill prices windows`: what a batch created now is billed at in each accepted completion
window, per model (`jobs.windows.window_prices`, the table `GET /v1/batch_prices` publishes):
the window's own price, or the model's general price times the window's multiplier.

Registered on `prices_app` by `backfill.admin_cli`, whose helpers it borrows when it runs.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from backfill.admin_common import admin_session as _session
from backfill.admin_common import domain_errors as _domain_errors
from backfill.admin_common import emit_rows as _emit

WINDOW_PRICE_COLUMNS = (
    "model",
    "completion_window",
    "priced_by",
    "multiplier",
    "input",
    "cached_input",
    "output",
    "batch_discount_percent",
    "version",
)


def prices_windows(
    model: Annotated[str | None, typer.Option("--model", help="Only this model.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Show the price in force now in every accepted completion window (shorter windows cost more)."""
    from backfill.jobs.billing import format_micros, list_prices
    from backfill.jobs.windows import window_prices
    from backfill.storage.settings import get_settings

    @_domain_errors
    def run() -> None:
        settings = get_settings()
        rows: list[dict[str, Any]] = []
        with _session() as session:
            models = [model] if model else sorted({p.model for p in list_prices(session)})
            for name in models:
                for row in window_prices(
                    session,
                    model=name,
                    windows=settings.completion_window_seconds,
                    multipliers=settings.price_multipliers,
                ):
                    rows.append(
                        {
                            "model": name,
                            "completion_window": row.completion_window,
                            "window_seconds": row.seconds,
                            "priced_by": row.priced_by,
                            "multiplier": str(row.multiplier),
                            "input": format_micros(row.rates.input),
                            "cached_input": format_micros(row.rates.cached_input),
                            "output": format_micros(row.rates.output),
                            "batch_discount_percent": row.rates.discount_percent,
                            "version": row.price.id,
                        }
                    )
        _emit(rows, as_json=as_json, title="prices per million tokens, per window", columns=WINDOW_PRICE_COLUMNS)

    run()
