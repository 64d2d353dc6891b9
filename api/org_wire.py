"""Wire shapes of the organization API (projects, keys, prices, quotas, usage, costs).

A backfill team is an OpenAI project: `proj_` + team id. Key ids get `key_`. Money leaves as
OpenAI's `{"value", "currency"}` (value in currency units) and, for prices, as exact decimal
strings; inside, it is integer micros.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from api.wire import ts
from jobs.billing import CURRENCY, MICROS_PER_UNIT, format_micros
from jobs.billing_models import Price, Quota
from jobs.errors import InvalidRequest, NotFound
from jobs.models import ApiKey, Team

PROJECT_PREFIX = "proj_"
KEY_PREFIX = "key_"


def from_unix(seconds: int, *, param: str) -> datetime:
    try:
        return datetime.fromtimestamp(seconds, tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise InvalidRequest(f"'{param}' is not a valid Unix time.", param=param) from None


def project_id_out(team_id: str) -> str:
    return PROJECT_PREFIX + team_id


def project_id_in(wire: str, *, param: str = "project_id") -> str:
    if not wire.startswith(PROJECT_PREFIX) or len(wire) <= len(PROJECT_PREFIX):
        raise NotFound(f"No project found with id '{wire}'.", param=param)
    return wire[len(PROJECT_PREFIX) :]


def key_id_in(wire: str) -> str:
    """A key id (`key_...`) or a key's visible prefix (`sk-bf-...`), as revocation accepts both."""
    return wire[len(KEY_PREFIX) :] if wire.startswith(KEY_PREFIX) else wire


def project_out(team: Team) -> dict[str, Any]:
    return {
        "id": project_id_out(team.id),
        "object": "organization.project",
        "name": team.name,
        "created_at": ts(team.created_at),
        "archived_at": None,
        "status": "active",
        "weight": team.weight,
    }


def key_out(key: ApiKey, *, raw: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": KEY_PREFIX + key.id,
        "object": "organization.project.api_key",
        "name": key.name,
        "redacted_value": key.prefix + "****",
        "project_id": project_id_out(key.team_id),
        "admin": key.is_admin,
        "created_at": ts(key.created_at),
        "revoked_at": ts(key.revoked_at),
    }
    if raw is not None:
        out["value"] = raw  # shown once, at creation; only its hash is stored
    return out


def price_out(price: Price) -> dict[str, Any]:
    return {
        "id": price.id,
        "object": "organization.price",
        "model": price.model,
        "completion_window": price.completion_window,
        "currency": CURRENCY,
        "unit": "1M tokens",
        "input": format_micros(price.input_micros_per_million),
        "cached_input": format_micros(price.cached_input_micros_per_million),
        "output": format_micros(price.output_micros_per_million),
        "batch_discount_percent": price.batch_discount_percent,
        "effective_from": ts(price.effective_from),
        "created_at": ts(price.created_at),
    }


def quota_out(quota: Quota) -> dict[str, Any]:
    return {
        "object": "organization.project.quota",
        "project_id": project_id_out(quota.team_id),
        "model": quota.model,
        "max_enqueued_tokens": quota.max_enqueued_tokens,
        "max_concurrent_batches": quota.max_concurrent_batches,
    }


def amount_out(micros: int) -> dict[str, Any]:
    # The only float, because OpenAI types an amount as a number; round(value * 1e6) gives the micros back.
    return {"value": micros / MICROS_PER_UNIT, "currency": CURRENCY}


def bucket_out(start: datetime, end: datetime, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "bucket", "start_time": ts(start), "end_time": ts(end), "results": results}


def usage_page(buckets: list[dict[str, Any]], next_page: str | None) -> dict[str, Any]:
    return {"object": "page", "data": buckets, "has_more": next_page is not None, "next_page": next_page}


def list_out(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0].get("id") if data else None,
        "last_id": data[-1].get("id") if data else None,
        "has_more": False,
    }
