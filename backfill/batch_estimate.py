"""`batch estimate`: a dry run of a batch input file, checked here by the server's own rules
(`jobs.validation.outcome.validate_lines`) against the models the server serves, without creating a batch.

Limits are the server's defaults (the API publishes no limits route), so a server configured
with smaller ones can still refuse a file this passes. The cost is at the price a batch created
now would be billed at (`GET /v1/batch_price`), an upper bound (every request's output at its
max tokens), for the window asked about and for every window the server accepts
(`GET /v1/batch_prices`: shorter windows cost more); the completion forecast is at the fleet's recent batch throughput with the work
queued ahead (`GET /v1/batch_throughput`). Both extension routes take any team key.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from backfill.jobs.endpoints import batch_endpoint
from backfill.jobs.errors import BatchError
from backfill.jobs.validation.input_lines import iter_lines
from backfill.jobs.validation.lines import max_output_tokens
from backfill.jobs.validation.scan import Limits, validate_lines
from backfill.storage.settings import Settings

if TYPE_CHECKING:
    import openai

    from backfill.jobs.billing.ledger import Rates

CHUNK_BYTES = 1 << 20


@dataclass
class Estimate:
    lines: int = 0
    requests: int = 0
    model: str | None = None
    prompt_tokens: int = 0
    max_output_tokens: int = 0
    errors: list[BatchError] = field(default_factory=list)
    cost: str | None = None  # an upper bound: every request's output at its max tokens
    currency: str | None = None
    price_id: int | None = None  # the price the cost is at
    cost_note: str | None = None  # why there is no cost, when there is none
    # The same upper bound in each accepted window (`batch.window_price` fields and the amount).
    window_costs: list[dict[str, Any]] | None = None
    window_costs_note: str | None = None  # why there is no table, when there is none
    throughput: dict[str, Any] | None = None  # the server's `batch.throughput`, as published
    forecast: datetime | None = None  # when the file would be done
    forecast_seconds: float | None = None
    forecast_note: str | None = "not asked for"  # why there is no forecast, when there is none

    def as_json(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "requests": self.requests,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "max_output_tokens": self.max_output_tokens,
            "cost": (
                {"amount": self.cost, "currency": self.currency, "price_id": self.price_id}
                if self.cost is not None
                else None
            ),
            "cost_note": self.cost_note,
            "costs_per_window": self.window_costs,
            "costs_per_window_note": self.window_costs_note,
            "throughput": self.throughput,
            "completion_forecast": (
                {"at": self.forecast.isoformat(), "in_seconds": round(self.forecast_seconds, 3)}
                if self.forecast is not None and self.forecast_seconds is not None
                else None
            ),
            "completion_forecast_note": self.forecast_note,
            "errors": self.errors,
        }


def server_default_limits() -> Limits:
    defaults = Settings.model_fields
    return Limits(
        max_requests=defaults["max_requests_per_batch"].default,
        max_line_bytes=defaults["max_line_bytes"].default,
        max_errors=defaults["max_reported_errors"].default,
    )


def _chunks(fh: IO[bytes]) -> Iterator[bytes]:
    while chunk := fh.read(CHUNK_BYTES):
        yield chunk


def estimate_file(path: Path, *, endpoint: str, served_models: set[str] | None) -> Estimate:
    with path.open("rb") as fh:
        result = validate_lines(
            _chunks(fh), endpoint=endpoint, served_models=served_models, limits=server_default_limits()
        )
    # The validation's per-request estimate is prompt + max output; the split needs the bodies'
    # max tokens, read in a second pass over the lines that validated.
    valid_lines = {r["line"] for r in result.requests}
    produces_output = batch_endpoint(endpoint).produces_output
    lines = 0
    max_output = 0
    with path.open("rb") as fh:
        for number, _, raw in iter_lines(_chunks(fh)):
            if not raw.strip():
                continue
            lines += 1
            if number in valid_lines and produces_output:
                max_output += max_output_tokens(orjson.loads(raw)["body"])
    return Estimate(
        lines=lines,
        requests=len(result.requests),
        model=result.model,
        prompt_tokens=result.token_estimate - max_output,
        max_output_tokens=max_output,
        errors=result.errors,
    )


def _extension(client: openai.OpenAI, path: str, params: dict[str, str | int]) -> tuple[dict[str, Any] | None, str]:
    """GET one of backfill's extension routes: (the object, "") or (None, why not).

    A 404 in backfill's envelope with a code is the route's own answer (`price_not_found`); one
    without (an unknown URL) means the server has no such route (not a backfill server, or an old one).
    """
    import openai

    try:
        body = client.get(path, cast_to=object, options={"params": params})
    except openai.APIStatusError as exc:
        error = exc.body if isinstance(exc.body, dict) else {}
        if exc.status_code == 404 and error.get("code") is None:
            return None, f"the server has no {path} route"
        message = " ".join(str(error.get("message") or exc.message).split())
        return None, f"HTTP {exc.status_code}: {message}"
    return (body, "") if isinstance(body, dict) else (None, f"{path} answered {type(body).__name__}, not an object")


def _rates(price: dict[str, Any]) -> Rates:
    from backfill.jobs.billing.ledger import Rates, parse_money

    return Rates(
        input=parse_money(price["input"], param="input"),
        cached_input=parse_money(price["cached_input"], param="cached_input"),
        output=parse_money(price["output"], param="output"),
        discount_percent=price["batch_discount_percent"],
    )


def _upper_bound(estimate: Estimate, price: dict[str, Any]) -> str:
    """The file's cost at `price` with every output at its max tokens, by the server's arithmetic."""

    from backfill.jobs.billing.ledger import format_micros, price_request

    cost = price_request(
        _rates(price),
        prompt_tokens=estimate.prompt_tokens,
        cached_tokens=0,
        completion_tokens=estimate.max_output_tokens,
    )
    return format_micros(cost.total_micros)


def add_cost(estimate: Estimate, client: openai.OpenAI, *, window: str) -> None:
    """Price the estimate at the price a batch created now would be billed at (`GET /batch_price`,
    readable with any key), with the server's own arithmetic (`jobs.billing.ledger.price_request`); then
    the same in every window the server accepts (`GET /batch_prices`)."""
    if estimate.model is None:
        estimate.cost_note = estimate.window_costs_note = "no model to price"
        return
    price, why = _extension(client, "/batch_price", {"model": estimate.model, "completion_window": window})
    if price is None:
        estimate.cost_note = why
    else:
        estimate.cost = _upper_bound(estimate, price)
        estimate.currency = price.get("currency")
        estimate.price_id = price.get("id")
    table, why = _extension(client, "/batch_prices", {"model": estimate.model})
    if table is None:
        estimate.window_costs_note = why
        return
    estimate.window_costs = [
        {
            "completion_window": row["completion_window"],
            "window_seconds": row["window_seconds"],
            "amount": _upper_bound(estimate, row),
            "currency": row["currency"],
            "price_id": row["price_id"],
            "priced_by": row["priced_by"],
            "multiplier": row["multiplier"],
        }
        for row in table["data"]
    ]


def add_forecast(estimate: Estimate, client: openai.OpenAI) -> None:
    """Forecast completion at the fleet's recent batch throughput (`GET /batch_throughput`, for
    the file's model when it has one): now + (the tokens queued ahead + this file's) / the tokens
    per second batch work got while it ran."""
    from backfill.jobs.billing.forecast import completion_forecast

    params: dict[str, str | int] = {"model": estimate.model} if estimate.model else {}
    throughput, why = _extension(client, "/batch_throughput", params)
    if throughput is None:
        estimate.forecast_note = why
        return
    estimate.throughput = {k: v for k, v in throughput.items() if k != "object"}
    forecast = completion_forecast(
        now=datetime.fromtimestamp(throughput["at"], tz=UTC),
        tokens=estimate.prompt_tokens + estimate.max_output_tokens,
        queued_tokens=throughput["queued_tokens"],
        tokens_per_second=throughput["busy_tokens_per_second"],
        window_s=throughput["window_s"],
    )
    if forecast.at is None or forecast.seconds is None:
        estimate.forecast_note = f"unknown: {forecast.reason}"
        return
    estimate.forecast = forecast.at
    estimate.forecast_seconds = forecast.seconds
    estimate.forecast_note = None


def _duration(seconds: float) -> str:
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def _cost_text(estimate: Estimate) -> str:
    text = f"at most {estimate.cost} {estimate.currency}" if estimate.cost is not None else "-"
    return text + (f" ({estimate.cost_note})" if estimate.cost_note else "")


def _forecast_text(estimate: Estimate) -> str:
    if estimate.forecast is None or estimate.forecast_seconds is None or estimate.throughput is None:
        note = estimate.forecast_note or ""
        return f"unknown ({note.removeprefix('unknown: ')})" if note.startswith("unknown") else f"- ({note})"
    t = estimate.throughput
    local = estimate.forecast.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    return (
        f"~{local}, in {_duration(estimate.forecast_seconds)}"
        f" ({estimate.prompt_tokens + estimate.max_output_tokens:,} + {t['queued_tokens']:,} queued tokens"
        f" at {t['busy_tokens_per_second']:,.1f} tok/s, the busy rate over the last {t['window_s']}s)"
    )


def _window_cost_lines(estimate: Estimate) -> list[str]:
    if estimate.window_costs is None:
        return [f"cost per window   : - ({estimate.window_costs_note})"]
    width = max((len(row["completion_window"]) for row in estimate.window_costs), default=0)
    lines = ["cost per window   :"]
    for row in estimate.window_costs:
        how = "its own price" if row["priced_by"] == "window" else f"general price x {row['multiplier']}"
        lines.append(f"  {row['completion_window']:<{width}}  at most {row['amount']} {row['currency']} ({how})")
    return lines


def report_lines(estimate: Estimate) -> list[str]:
    lines = [
        f"lines             : {estimate.lines} ({estimate.requests} valid)",
        f"model             : {estimate.model or '-'}",
        f"prompt tokens     : ~{estimate.prompt_tokens:,} (estimated)",
        f"max output tokens : {estimate.max_output_tokens:,}",
        f"cost              : {_cost_text(estimate)}",
        *_window_cost_lines(estimate),
        f"completion        : {_forecast_text(estimate)}",
    ]
    if estimate.errors:
        lines.append(f"errors ({len(estimate.errors)}):")
        lines += [
            f"  line {e['line'] if e['line'] is not None else '-'}: {e['code']}: {e['message']}"
            for e in estimate.errors
        ]
    else:
        lines.append("no validation errors")
    return lines
