"""Administration commands: `backfill teams|keys|prices|quotas ...` and `backfill usage`.

They work on whatever database BACKFILL_DATABASE_URL names (the embedded SQLite file when
unset) through the same services as the admin HTTP routes. Every command takes `--json`.
"""

from __future__ import annotations

import csv
import json
import sys
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer

from backfill.admin_common import admin_session as _session
from backfill.admin_common import domain_errors as _domain_errors
from backfill.admin_common import emit_rows as _emit
from backfill.prices_windows import prices_windows

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from backfill.jobs.billing_models import Price, Quota
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
    from backfill.jobs.billing import format_micros

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
@_domain_errors
def teams_create(
    name: Annotated[str, typer.Argument(help="Unique team name.")],
    weight: Annotated[int, typer.Option(min=1, help="Fair-share weight (2 = twice the share of 1).")] = 1,
    as_json: JsonOption = False,
) -> None:
    """Create a team."""
    from backfill.jobs.teams import create_team

    with _session() as session:
        row = _team_row(create_team(session, name=name, weight=weight))
    _emit([row], as_json=as_json, title="team created", columns=TEAM_COLUMNS, single=True)


@teams_app.command("list")
@_domain_errors
def teams_list(as_json: JsonOption = False) -> None:
    """List teams."""
    from backfill.jobs.teams import list_teams

    with _session() as session:
        rows = [_team_row(t) for t in list_teams(session)]
    _emit(rows, as_json=as_json, title="teams", columns=TEAM_COLUMNS)


@keys_app.command("create")
@_domain_errors
def keys_create(
    team: Annotated[str, typer.Option("--team", help="Team name or id.")],
    admin: Annotated[bool, typer.Option("--admin", help="An admin key (administration routes, all teams).")] = False,
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
    as_json: JsonOption = False,
) -> None:
    """Create an API key and print it: this is the only time it is shown."""
    from backfill.jobs.teams import create_key

    with _session() as session:
        owner = _team(session, team)
        key, raw = create_key(session, team_id=owner.id, name=name, is_admin=admin)
        row = _key_row(key, {owner.id: owner.name}, raw=raw)
    if as_json:
        typer.echo(json.dumps(row, indent=2))
        return
    typer.echo(f"key {row['id']} for team {owner.name} ({row['prefix']}...); it is not shown again:")
    typer.echo(raw)


@keys_app.command("list")
@_domain_errors
def keys_list(
    team: Annotated[str | None, typer.Option("--team", help="Only this team's keys.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List keys (prefixes only; a key itself is never stored)."""
    from backfill.jobs.teams import list_keys

    with _session() as session:
        team_id = _team(session, team).id if team else None
        names = _team_names(session)
        rows = [_key_row(k, names) for k in list_keys(session, team_id=team_id)]
    _emit(rows, as_json=as_json, title="API keys", columns=KEY_COLUMNS)


@keys_app.command("revoke")
@_domain_errors
def keys_revoke(
    key: Annotated[str, typer.Argument(help="Key id or visible prefix (sk-bf-xxxxxx).")],
    as_json: JsonOption = False,
) -> None:
    """Revoke a key: it answers 401 from its next request on."""
    from backfill.jobs.teams import revoke_key

    with _session() as session:
        row = _key_row(revoke_key(session, key_id_or_prefix=key.removeprefix("key_")), _team_names(session))
    _emit([row], as_json=as_json, title="key revoked", columns=KEY_COLUMNS, single=True)


@prices_app.command("set")
@_domain_errors
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
    from backfill.jobs import billing
    from backfill.storage.settings import parse_duration

    if window is not None:
        try:
            parse_duration(window)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--window") from None
    with _session() as session:
        price = billing.set_price(
            session,
            model=model,
            input_micros=billing.parse_money(input_price, param="input"),
            cached_input_micros=billing.parse_money(cached_input, param="cached_input"),
            output_micros=billing.parse_money(output, param="output"),
            discount_percent=discount,
            completion_window=window,
        )
        row = _price_row(price)
    _emit([row], as_json=as_json, title="price set", columns=PRICE_COLUMNS, single=True)


@prices_app.command("list")
@_domain_errors
def prices_list(
    model: Annotated[str | None, typer.Option("--model", help="Only this model.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List every price version."""
    from backfill.jobs.billing import list_prices

    with _session() as session:
        rows = [_price_row(p) for p in list_prices(session, model=model)]
    _emit(rows, as_json=as_json, title="prices per million tokens", columns=PRICE_COLUMNS)


prices_app.command("windows")(prices_windows)


@quotas_app.command("set")
@_domain_errors
def quotas_set(
    team: TeamArg,
    model: Annotated[str, typer.Argument(help="Model id.")],
    max_enqueued_tokens: Annotated[int | None, typer.Option(min=0, help="Cap on enqueued tokens.")] = None,
    max_concurrent_batches: Annotated[int | None, typer.Option(min=0, help="Cap on unfinished batches.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Set (or replace) a team's caps for one model; an omitted cap means none."""
    from backfill.jobs.quotas import set_quota

    with _session() as session:
        owner = _team(session, team)
        quota = set_quota(
            session,
            team_id=owner.id,
            model=model,
            max_enqueued_tokens=max_enqueued_tokens,
            max_concurrent_batches=max_concurrent_batches,
        )
        row = _quota_row(quota, {owner.id: owner.name})
    _emit([row], as_json=as_json, title="quota set", columns=QUOTA_COLUMNS, single=True)


@quotas_app.command("list")
@_domain_errors
def quotas_list(
    team: Annotated[str | None, typer.Option("--team", help="Only this team's quotas.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List quotas."""
    from backfill.jobs.quotas import list_quotas

    with _session() as session:
        team_id = _team(session, team).id if team else None
        names = _team_names(session)
        rows = [_quota_row(q, names) for q in list_quotas(session, team_id=team_id)]
    _emit(rows, as_json=as_json, title="quotas", columns=QUOTA_COLUMNS)


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


@_domain_errors
def usage(
    team: Annotated[str | None, typer.Option("--team", help="Only this team (default: all).")] = None,
    days: Annotated[int, typer.Option("--days", min=1, max=366, help="Days back, today included.")] = 7,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Usage and cost per day (UTC), team and model, from the usage ledger."""
    from backfill.jobs.billing import CURRENCY, format_micros
    from backfill.jobs.models import utcnow
    from backfill.jobs.usage import BUCKET_WIDTHS, align, usage_totals

    day = BUCKET_WIDTHS["1d"]
    today = align(utcnow(), day)
    with _session() as session:
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
    _emit(rows, as_json=as_json, title=f"usage, last {days} days ({CURRENCY})", columns=USAGE_COLUMNS)
