"""Wire conversions of the organization API (projects, keys, prices, quotas, usage, costs).

A backfill team is an OpenAI project: `proj_` + team id. Key ids get `key_`. Money leaves as
OpenAI's `{"value", "currency"}` (value in currency units) and, for prices, as exact decimal
strings; inside, it is integer micros.
"""

from __future__ import annotations

from datetime import UTC, datetime

from backfill.api import protocol
from backfill.api.wire import ts
from backfill.jobs.billing.ledger import CURRENCY, MICROS_PER_UNIT, format_micros
from backfill.jobs.billing.models import Price, Quota
from backfill.jobs.errors import InvalidRequest, NotFound
from backfill.jobs.models import ApiKey, Team

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


def key_id_out(key_id: str) -> str:
    return KEY_PREFIX + key_id


def key_id_in(wire: str) -> str:
    """A key id (`key_...`) or a key's visible prefix (`sk-bf-...`), as revocation accepts both."""
    return wire[len(KEY_PREFIX) :] if wire.startswith(KEY_PREFIX) else wire


def project_out(team: Team) -> protocol.Project:
    return protocol.Project(
        id=project_id_out(team.id),
        object="organization.project",
        name=team.name,
        created_at=ts(team.created_at),
        archived_at=None,
        status="active",
        weight=team.weight,
    )


def key_out(key: ApiKey) -> protocol.ProjectApiKey:
    return protocol.ProjectApiKey(
        id=key_id_out(key.id),
        object="organization.project.api_key",
        name=key.name,
        redacted_value=key.prefix + "****",
        project_id=project_id_out(key.team_id),
        admin=key.is_admin,
        created_at=ts(key.created_at),
        revoked_at=ts(key.revoked_at),
    )


def created_key_out(key: ApiKey, *, raw: str) -> protocol.CreatedProjectApiKey:
    """The key as created: the only time its raw value is shown (only its hash is stored)."""
    return protocol.CreatedProjectApiKey.model_validate({**key_out(key).model_dump(), "value": raw})


def key_deleted_out(key: ApiKey) -> protocol.ProjectApiKeyDeleted:
    return protocol.ProjectApiKeyDeleted(
        object="organization.project.api_key.deleted", id=key_id_out(key.id), deleted=True
    )


def price_out(price: Price) -> protocol.Price:
    return protocol.Price(
        id=price.id,
        object="organization.price",
        model=price.model,
        completion_window=price.completion_window,
        currency=CURRENCY,
        unit="1M tokens",
        input=format_micros(price.input_micros_per_million),
        cached_input=format_micros(price.cached_input_micros_per_million),
        output=format_micros(price.output_micros_per_million),
        batch_discount_percent=price.batch_discount_percent,
        effective_from=ts(price.effective_from),
        created_at=ts(price.created_at),
    )


def price_page(prices: list[Price]) -> protocol.PriceList:
    wire = [price_out(p) for p in prices]
    first, last = (wire[0].id, wire[-1].id) if wire else (None, None)
    return protocol.PriceList(object="list", data=wire, first_id=first, last_id=last, has_more=False)


def quota_out(quota: Quota) -> protocol.Quota:
    return protocol.Quota(
        object="organization.project.quota",
        project_id=project_id_out(quota.team_id),
        model=quota.model,
        max_enqueued_tokens=quota.max_enqueued_tokens,
        max_concurrent_batches=quota.max_concurrent_batches,
    )


def amount_out(micros: int) -> protocol.Amount:
    return protocol.Amount(value=micros / MICROS_PER_UNIT, currency=CURRENCY)
