"""Administration commands: `backfill teams|keys|prices|quotas ...` and `backfill usage`.

They work on whatever database BACKFILL_DATABASE_URL names (the embedded SQLite file when
unset) through the same services as the admin HTTP routes. Every command takes `--json`.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from functools import wraps
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from backfill.jobs.billing.models import Price, Quota
    from backfill.jobs.models import ApiKey, Team

P = ParamSpec("P")
R = TypeVar("R")

teams_app = typer.Typer(
    help="Teams (OpenAI projects): every file, batch and token belongs to one.", no_args_is_help=True
)
keys_app = typer.Typer(help="API keys: shown once at creation, stored as a hash.", no_args_is_help=True)
prices_app = typer.Typer(help="Versioned prices per model (per million tokens).", no_args_is_help=True)
quotas_app = typer.Typer(help="Per-team, per-model caps checked when a batch is validated.", no_args_is_help=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
TeamArg = Annotated[str, typer.Argument(help="Team name or id.")]


# What the administration commands share: a session on the configured database, domain errors
# as one line and exit 1, rows as a table or JSON.


@contextmanager
def admin_session() -> Iterator[Session]:
    from backfill.storage.db import unit_of_work
    from backfill.storage.settings import get_settings

    if get_settings().embedded:
        from backfill.migrate import upgrade

        upgrade()  # the embedded database is created on first use, as `backfill up` would
    with unit_of_work() as session:
        yield session


def domain_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Expected failures (unknown team, duplicate name, bad amount) end with a message, not a trace."""

    @wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        from backfill.jobs.errors import DomainError

        try:
            return command(*args, **kwargs)
        except DomainError as exc:
            typer.secho(f"error: {exc.message}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None

    return run


def emit_rows(
    rows: list[dict[str, Any]], *, as_json: bool, title: str, columns: Sequence[str], single: bool = False
) -> None:
    if as_json:
        typer.echo(json.dumps(rows[0] if single else rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*("" if row.get(c) is None else str(row.get(c)) for c in columns))
    # Piped or in a narrow terminal, rich would cut the columns to 80 characters: give it room.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _team(session: Session, ref: str) -> Team:
    from backfill.jobs.teams import find_team

    return find_team(session, name_or_id=ref.removeprefix("proj_"))


def _team_row(team: Team) -> dict[str, Any]:
    return {"id": team.id, "name": team.name, "weight": team.weight, "created_at": _iso(team.created_at)}


def _key_row(key: ApiKey, team_names: dict[str, str], raw: str | None = None) -> dict[str, Any]:
    row = {
        "id": key.id,
        "team_id": key.team_id,
        "team": team_names.get(key.team_id, key.team_id),
        "name": key.name,
        "prefix": key.prefix,
        "admin": key.is_admin,
        "created_at": _iso(key.created_at),
        "revoked_at": _iso(key.revoked_at),
    }
    if raw is not None:
        row["key"] = raw
    return row


def _price_row(price: Price) -> dict[str, Any]:
    from backfill.jobs.billing.ledger import format_micros

    return {
        "version": price.id,
        "model": price.model,
        "completion_window": price.completion_window,
        "input": format_micros(price.input_micros_per_million),
        "cached_input": format_micros(price.cached_input_micros_per_million),
        "output": format_micros(price.output_micros_per_million),
        "input_micros_per_million": price.input_micros_per_million,
        "cached_input_micros_per_million": price.cached_input_micros_per_million,
        "output_micros_per_million": price.output_micros_per_million,
        "batch_discount_percent": price.batch_discount_percent,
        "effective_from": _iso(price.effective_from),
    }


def _quota_row(quota: Quota, team_names: dict[str, str]) -> dict[str, Any]:
    return {
        "team_id": quota.team_id,
        "team": team_names.get(quota.team_id, quota.team_id),
        "model": quota.model,
        "max_enqueued_tokens": quota.max_enqueued_tokens,
        "max_concurrent_batches": quota.max_concurrent_batches,
    }


def _team_names(session: Session) -> dict[str, str]:
    from backfill.jobs.teams import list_teams

    return {t.id: t.name for t in list_teams(session)}


TEAM_COLUMNS = ("id", "name", "weight", "created_at")
KEY_COLUMNS = ("id", "team", "name", "prefix", "admin", "created_at", "revoked_at")
PRICE_COLUMNS = ("version", "model", "completion_window", "input", "cached_input", "output", "batch_discount_percent")
QUOTA_COLUMNS = ("team", "model", "max_enqueued_tokens", "max_concurrent_batches")


@teams_app.command("create")
@domain_errors
def teams_create(
    name: Annotated[str, typer.Argument(help="Unique team name.")],
    weight: Annotated[int, typer.Option(min=1, help="Fair-share weight (2 = twice the share of 1).")] = 1,
    as_json: JsonOption = False,
) -> None:
    """Create a team."""
    from backfill.jobs.teams import create_team

    with admin_session() as session:
        row = _team_row(create_team(session, name=name, weight=weight))
    emit_rows([row], as_json=as_json, title="team created", columns=TEAM_COLUMNS, single=True)


@teams_app.command("list")
@domain_errors
def teams_list(as_json: JsonOption = False) -> None:
    """List teams."""
    from backfill.jobs.teams import list_teams

    with admin_session() as session:
        rows = [_team_row(t) for t in list_teams(session)]
    emit_rows(rows, as_json=as_json, title="teams", columns=TEAM_COLUMNS)


@keys_app.command("create")
@domain_errors
def keys_create(
    team: Annotated[str, typer.Option("--team", help="Team name or id.")],
    admin: Annotated[bool, typer.Option("--admin", help="An admin key (administration routes, all teams).")] = False,
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
    as_json: JsonOption = False,
) -> None:
    """Create an API key and print it: this is the only time it is shown."""
    from backfill.jobs.teams import create_key

    with admin_session() as session:
        owner = _team(session, team)
        key, raw = create_key(session, team_id=owner.id, name=name, is_admin=admin)
        row = _key_row(key, {owner.id: owner.name}, raw=raw)
    if as_json:
        typer.echo(json.dumps(row, indent=2))
        return
    typer.echo(f"key {row['id']} for team {owner.name} ({row['prefix']}...); it is not shown again:")
    typer.echo(raw)


@keys_app.command("list")
@domain_errors
def keys_list(
    team: Annotated[str | None, typer.Option("--team", help="Only this team's keys.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List keys (prefixes only; a key itself is never stored)."""
    from backfill.jobs.teams import list_keys

    with admin_session() as session:
        team_id = _team(session, team).id if team else None
        names = _team_names(session)
        rows = [_key_row(k, names) for k in list_keys(session, team_id=team_id)]
    emit_rows(rows, as_json=as_json, title="API keys", columns=KEY_COLUMNS)


@keys_app.command("revoke")
@domain_errors
def keys_revoke(
    key: Annotated[str, typer.Argument(help="Key id or visible prefix (sk-bf-xxxxxx).")],
    as_json: JsonOption = False,
) -> None:
    """Revoke a key: it answers 401 from its next request on."""
    from backfill.jobs.teams import revoke_key

    with admin_session() as session:
        row = _key_row(revoke_key(session, key_id_or_prefix=key.removeprefix("key_")), _team_names(session))
    emit_rows([row], as_json=as_json, title="key revoked", columns=KEY_COLUMNS, single=True)


@prices_app.command("set")
@domain_errors
def prices_set(
    model: Annotated[str, typer.Argument(help="Model id as batch lines name it.")],
    input_price: Annotated[str, typer.Option("--input", help="Input price per million tokens, e.g. 2.50.")],
    cached_input: Annotated[str, typer.Option("--cached-input", help="Cached input price per million tokens.")],
    output: Annotated[str, typer.Option("--output", help="Output price per million tokens.")],
    discount: Annotated[int, typer.Option("--discount", min=0, max=100, help="Batch discount, percent.")] = 50,
    window: Annotated[
        str | None,
        typer.Option("--window", help="Only for this completion window (e.g. 7d); default all, at their multipliers."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Add a price version; batches created from now on are billed at it."""
    from backfill.jobs.billing.ledger import parse_money, set_price
    from backfill.storage.settings import parse_duration

    if window is not None:
        try:
            parse_duration(window)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--window") from None
    with admin_session() as session:
        price = set_price(
            session,
            model=model,
            input_micros=parse_money(input_price, param="input"),
            cached_input_micros=parse_money(cached_input, param="cached_input"),
            output_micros=parse_money(output, param="output"),
            discount_percent=discount,
            completion_window=window,
        )
        row = _price_row(price)
    emit_rows([row], as_json=as_json, title="price set", columns=PRICE_COLUMNS, single=True)


@prices_app.command("list")
@domain_errors
def prices_list(
    model: Annotated[str | None, typer.Option("--model", help="Only this model.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List every price version."""
    from backfill.jobs.billing.ledger import list_prices

    with admin_session() as session:
        rows = [_price_row(p) for p in list_prices(session, model=model)]
    emit_rows(rows, as_json=as_json, title="prices per million tokens", columns=PRICE_COLUMNS)


@quotas_app.command("set")
@domain_errors
def quotas_set(
    team: TeamArg,
    model: Annotated[str, typer.Argument(help="Model id.")],
    max_enqueued_tokens: Annotated[int | None, typer.Option(min=0, help="Cap on enqueued tokens.")] = None,
    max_concurrent_batches: Annotated[int | None, typer.Option(min=0, help="Cap on unfinished batches.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Set (or replace) a team's caps for one model; an omitted cap means none."""
    from backfill.jobs.billing.quotas import set_quota

    with admin_session() as session:
        owner = _team(session, team)
        quota = set_quota(
            session,
            team_id=owner.id,
            model=model,
            max_enqueued_tokens=max_enqueued_tokens,
            max_concurrent_batches=max_concurrent_batches,
        )
        row = _quota_row(quota, {owner.id: owner.name})
    emit_rows([row], as_json=as_json, title="quota set", columns=QUOTA_COLUMNS, single=True)


@quotas_app.command("list")
@domain_errors
def quotas_list(
    team: Annotated[str | None, typer.Option("--team", help="Only this team's quotas.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List quotas."""
    from backfill.jobs.billing.quotas import list_quotas

    with admin_session() as session:
        team_id = _team(session, team).id if team else None
        names = _team_names(session)
        rows = [_quota_row(q, names) for q in list_quotas(session, team_id=team_id)]
    emit_rows(rows, as_json=as_json, title="quotas", columns=QUOTA_COLUMNS)


USAGE_COLUMNS = (
    "day",
    "team",
    "model",
    "requests",
    "input_tokens",
    "cached_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cost",
)


@domain_errors
def usage(
    team: Annotated[str | None, typer.Option("--team", help="Only this team (default: all).")] = None,
    days: Annotated[int, typer.Option("--days", min=1, max=366, help="Days back, today included.")] = 7,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Usage and cost per day (UTC), team and model, from the usage ledger."""
    from backfill.jobs.billing.ledger import CURRENCY, format_micros
    from backfill.jobs.billing.usage import BUCKET_WIDTHS, align, usage_totals
    from backfill.jobs.models import utcnow

    day = BUCKET_WIDTHS["1d"]
    today = align(utcnow(), day)
    with admin_session() as session:
        team_ids = [_team(session, team).id] if team else None
        names = _team_names(session)
        totals = usage_totals(
            session,
            start=today - timedelta(days=days - 1),
            end=today + timedelta(days=1),
            width_s=day,
            team_ids=team_ids,
            by_team=True,
            by_model=True,
        )
    rows: list[dict[str, Any]] = [
        {
            "day": t.bucket_start.date().isoformat(),
            "team_id": t.team_id,
            "team": names.get(t.team_id or "", t.team_id),
            "model": t.model,
            "requests": t.requests,
            "input_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens,
            "output_tokens": t.completion_tokens,
            "reasoning_tokens": t.reasoning_tokens,
            "cost_micros": t.cost_micros,
            "cost": format_micros(t.cost_micros),
            "currency": CURRENCY,
        }
        for t in totals
    ]
    if as_csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]) if rows else list(USAGE_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
        return
    if not as_json and rows:
        total: dict[str, Any] = {k: sum(int(r[k]) for r in rows) for k in (*USAGE_COLUMNS[3:8], "cost_micros")}
        rows.append({**total, "day": "total", "cost": format_micros(total["cost_micros"])})
    emit_rows(rows, as_json=as_json, title=f"usage, last {days} days ({CURRENCY})", columns=USAGE_COLUMNS)


# `backfill prices windows`: what a batch created now is billed at in each accepted completion
# window, per model (`jobs.billing.windows.window_prices`, the table `GET /v1/batch_prices` publishes):
# the window's own price, or the model's general price times the window's multiplier.
#
# Registered on `prices_app` by `backfill.admin_cli`, whose helpers it borrows when it runs.

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
    from backfill.jobs.billing.ledger import format_micros, list_prices
    from backfill.jobs.billing.windows import window_prices
    from backfill.storage.settings import get_settings

    @domain_errors
    def run() -> None:
        settings = get_settings()
        rows: list[dict[str, Any]] = []
        with admin_session() as session:
            models = [model] if model else sorted({p.model for p in list_prices(session)})
            for name in models:
                for row in window_prices(
                    session,
                    model=name,
                    windows=settings.completion_windows,
                    multipliers=settings.window_price_multipliers,
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
        emit_rows(rows, as_json=as_json, title="prices per million tokens, per window", columns=WINDOW_PRICE_COLUMNS)

    run()


prices_app.command("windows")(prices_windows)
