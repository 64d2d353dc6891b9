"""`batch estimate`: a dry run of a batch input file, checked here by the server's own rules
(`jobs.validation.validate_lines`) against the models the server serves, without creating a batch.

Limits are the server's defaults (the API publishes no limits route), so a server configured
with smaller ones can still refuse a file this passes. The cost is shown when the key may read
the price list (an admin key); a completion forecast needs the fleet's batch throughput, which
no route publishes yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from jobs import validation
from storage.settings import Settings

if TYPE_CHECKING:
    import openai

CHUNK_BYTES = 1 << 20
FORECAST_MISSING = "needs a route publishing the fleet's batch throughput"


@dataclass
class Estimate:
    lines: int = 0
    requests: int = 0
    model: str | None = None
    prompt_tokens: int = 0
    max_output_tokens: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    cost: str | None = None  # an upper bound: every request's output at its max tokens
    currency: str | None = None
    cost_note: str | None = None  # why there is no cost, when there is none
    forecast: str | None = None
    forecast_note: str | None = FORECAST_MISSING

    def as_json(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "requests": self.requests,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "max_output_tokens": self.max_output_tokens,
            "cost": {"amount": self.cost, "currency": self.currency} if self.cost is not None else None,
            "cost_note": self.cost_note,
            "completion_forecast": self.forecast,
            "completion_forecast_note": self.forecast_note,
            "errors": self.errors,
        }


def server_default_limits() -> validation.Limits:
    defaults = Settings.model_fields
    return validation.Limits(
        max_requests=defaults["max_requests_per_batch"].default,
        max_line_bytes=defaults["max_line_bytes"].default,
        max_errors=defaults["max_reported_errors"].default,
    )


def _chunks(fh: IO[bytes]) -> Iterator[bytes]:
    while chunk := fh.read(CHUNK_BYTES):
        yield chunk


def estimate_file(path: Path, *, endpoint: str, served_models: set[str] | None) -> Estimate:
    with path.open("rb") as fh:
        result = validation.validate_lines(
            _chunks(fh), endpoint=endpoint, served_models=served_models, limits=server_default_limits()
        )
    # The validation's per-request estimate is prompt + max output; the split needs the bodies'
    # max tokens, read in a second pass over the lines that validated.
    valid_lines = {r["line"] for r in result.requests}
    lines = 0
    max_output = 0
    with path.open("rb") as fh:
        for number, _, raw in validation.iter_lines(_chunks(fh)):
            if not raw.strip():
                continue
            lines += 1
            if number in valid_lines and endpoint != "/v1/embeddings":
                max_output += validation.max_output_tokens(orjson.loads(raw)["body"])
    return Estimate(
        lines=lines,
        requests=len(result.requests),
        model=result.model,
        prompt_tokens=result.token_estimate - max_output,
        max_output_tokens=max_output,
        errors=result.errors,
    )


def _price_in_force(rows: list[dict[str, Any]], *, model: str, window: str, now: float) -> dict[str, Any] | None:
    """The server's choice (`jobs.billing.price_in_force`): a window-specific price wins over the
    general one, then the latest effective, then the newest."""
    candidates = [
        p
        for p in rows
        if p.get("model") == model
        and p.get("effective_from", 0) <= now
        and p.get("completion_window") in (window, None)
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda p: (p["completion_window"] is None, -p["effective_from"], -p["id"]))


def add_cost(estimate: Estimate, client: openai.OpenAI, *, window: str) -> None:
    """Price the estimate at the prices in force now, if this key may read them."""
    import openai

    from jobs import billing

    if estimate.model is None:
        estimate.cost_note = "no model to price"
        return
    try:
        page = client.get("/organization/prices", cast_to=object, options={"params": {"model": estimate.model}})
    except openai.APIStatusError as exc:
        if exc.status_code in (401, 403, 404):
            estimate.cost_note = (
                f"prices are not readable with this key (HTTP {exc.status_code}; they need an admin key)"
            )
            return
        raise
    rows = page.get("data", []) if isinstance(page, dict) else []
    price = _price_in_force(rows, model=estimate.model, window=window, now=time.time())
    if price is None:
        estimate.cost_note = f"no price is set for {estimate.model!r}"
        return
    rates = billing.Rates(
        input=billing.parse_money(price["input"], param="input"),
        cached_input=billing.parse_money(price["cached_input"], param="cached_input"),
        output=billing.parse_money(price["output"], param="output"),
        discount_percent=price["batch_discount_percent"],
    )
    cost = billing.price_request(
        rates, prompt_tokens=estimate.prompt_tokens, cached_tokens=0, completion_tokens=estimate.max_output_tokens
    )
    estimate.cost = billing.format_micros(cost.total_micros)
    estimate.currency = price.get("currency")


def report_lines(estimate: Estimate) -> list[str]:
    lines = [
        f"lines             : {estimate.lines} ({estimate.requests} valid)",
        f"model             : {estimate.model or '-'}",
        f"prompt tokens     : ~{estimate.prompt_tokens:,} (estimated)",
        f"max output tokens : {estimate.max_output_tokens:,}",
        f"cost              : {f'at most {estimate.cost} {estimate.currency}' if estimate.cost else '-'}"
        + (f" ({estimate.cost_note})" if estimate.cost_note else ""),
        f"completion        : {estimate.forecast or '-'}"
        + (f" ({estimate.forecast_note})" if estimate.forecast_note else ""),
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
