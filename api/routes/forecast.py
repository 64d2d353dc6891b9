"""Extensions for following and planning batches, readable with any team key:

- `GET /v1/batches/{batch_id}/cost`: what the batch has cost so far (the usage ledger), scoped to
  the caller's team like the Batches routes (another team's batch answers their 404).
- `GET /v1/batch_price?model=&completion_window=`: the price a batch created now would be billed
  at (`jobs.billing.windows.window_price` at the current price version), as the organization's price object.
- `GET /v1/batch_prices?model=`: the same for every accepted completion window, each saying whether
  the window has a price of its own or pays the general price times its multiplier.
- `GET /v1/batch_throughput`: the fleet's batch throughput over a recent window and the work
  queued in in-progress batches, summed over every team; the CLI forecasts completion from it.

The OpenAI routes are untouched: these are separate paths. The numbers come from `jobs.billing.forecast`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from backfill.api.deps import CurrentPrincipal, DbSession
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import BatchCost, BatchThroughput, BatchWindowPrice, BatchWindowPriceList, Price
from backfill.api.wire import batch_id_in, batch_id_out, price_out, ts
from backfill.jobs import batches as batch_service
from backfill.jobs.billing import forecast, windows
from backfill.jobs.billing.ledger import CURRENCY, format_micros
from backfill.jobs.errors import NotFound
from backfill.storage.settings import get_settings

router = APIRouter(prefix="/v1", tags=["batches"], responses=error_responses(*COMMON_ERRORS))


def _model_query() -> Any:
    """A model name as a batch line may give it: no control characters (Postgres refuses NUL)."""
    return Query(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")


@router.get("/batches/{batch_id}/cost")
def batch_cost(batch_id: str, principal: CurrentPrincipal, session: DbSession) -> BatchCost:
    """What the batch has cost so far: the sum of its usage ledger entries (executed requests;
    failed, cancelled and expired lines cost nothing), at the price in force when it was created."""
    batch = batch_service.get_batch(session, team_id=principal.team_id, batch_id=batch_id_in(batch_id))
    cost = forecast.cost_so_far(session, batch)
    return BatchCost(
        object="batch.cost",
        batch_id=batch_id_out(batch.id),
        amount=format_micros(cost.cost_micros),
        currency=CURRENCY,
        price_id=cost.price.id if cost.price is not None else None,
        requests=cost.requests,
        input_tokens=cost.prompt_tokens,
        cached_tokens=cost.cached_tokens,
        output_tokens=cost.completion_tokens,
    )


def _no_price(model: str, window: str | None = None) -> NotFound:
    which = f"model {model!r} and completion window {window!r}" if window else f"model {model!r} in any window"
    return NotFound(f"No price is in force for {which}.", param="model", code="price_not_found")


@router.get("/batch_price")
def batch_price(
    _: CurrentPrincipal,
    session: DbSession,
    model: Annotated[str, _model_query()],
    completion_window: str = "24h",
) -> Price:
    """The price a batch of `model` created now with `completion_window` would be billed at: the
    window's own price if one is set, else the general one times the window's multiplier (the
    object then carries the general row's id and null window, with the multiplied amounts). 404
    (`price_not_found`) when none is in force: such a batch's usage would be recorded at zero cost."""
    settings = get_settings()
    seconds = windows.check_window(completion_window, settings.completion_windows)
    priced = windows.window_price(
        session,
        model=model,
        completion_window=completion_window,
        seconds=seconds,
        multipliers=settings.window_price_multipliers,
    )
    if priced is None:
        raise _no_price(model, completion_window)
    rates = priced.rates
    return price_out(priced.price).model_copy(
        update={
            "input": format_micros(rates.input),
            "cached_input": format_micros(rates.cached_input),
            "output": format_micros(rates.output),
        }
    )


@router.get("/batch_prices")
def batch_prices(
    _: CurrentPrincipal, session: DbSession, model: Annotated[str, _model_query()]
) -> BatchWindowPriceList:
    """What a batch of `model` created now is billed at in each accepted completion window
    (shortest first; a window without a price in force is left out). 404 (`price_not_found`)
    when no window has one."""
    settings = get_settings()
    table = windows.window_prices(
        session, model=model, windows=settings.completion_windows, multipliers=settings.window_price_multipliers
    )
    if not table:
        raise _no_price(model)
    return BatchWindowPriceList(
        object="list",
        data=[
            BatchWindowPrice(
                object="batch.window_price",
                completion_window=row.completion_window,
                window_seconds=row.seconds,
                model=model,
                price_id=row.price.id,
                priced_by=row.priced_by,
                multiplier=str(row.multiplier),
                currency=CURRENCY,
                unit="1M tokens",
                input=format_micros(row.rates.input),
                cached_input=format_micros(row.rates.cached_input),
                output=format_micros(row.rates.output),
                batch_discount_percent=row.rates.discount_percent,
            )
            for row in table
        ],
    )


@router.get("/batch_throughput")
def batch_throughput(
    _: CurrentPrincipal,
    session: DbSession,
    window_s: Annotated[int, Query(ge=forecast.MIN_WINDOW_S, le=forecast.MAX_WINDOW_S)] = forecast.DEFAULT_WINDOW_S,
    model: Annotated[str | None, _model_query()] = None,
) -> BatchThroughput:
    """Batch requests and tokens the fleet executed over the last `window_s` seconds (every team,
    one model if `model` is given), per second over the whole window and over its busy part (the
    10 s steps in which results were recorded), and the lines left in in-progress batches with
    their share of the batches' token estimates (from the batches' counters, as the scheduler
    sees them). Completion of new work is about
    now + (queued_tokens + its tokens) / busy_tokens_per_second; unknown while that is 0."""
    numbers = forecast.batch_throughput(session, window_s=window_s, model=model)
    return BatchThroughput(
        object="batch.throughput",
        at=ts(numbers.at),
        window_s=numbers.window_s,
        model=model,
        requests=numbers.requests,
        tokens=numbers.tokens,
        requests_per_second=numbers.requests_per_second,
        tokens_per_second=numbers.tokens_per_second,
        busy_s=numbers.busy_s,
        busy_requests_per_second=numbers.busy_requests_per_second,
        busy_tokens_per_second=numbers.busy_tokens_per_second,
        queued_requests=numbers.queued_requests,
        queued_tokens=numbers.queued_tokens,
        running_batches=numbers.running_batches,
    )
