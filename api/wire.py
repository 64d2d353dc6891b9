"""OpenAI wire conversions, from rows to `api.protocol`'s schemas and back: ids get their prefixes
and timestamps become Unix seconds only here (files, batches, the organization API, webhooks)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import overload

from backfill.api import protocol
from backfill.api.protocol import (
    DeliveryAttempt,
    WebhookDeliveryObject,
    WebhookEndpointObject,
    WebhookEndpointWithSecret,
)
from backfill.jobs.billing.ledger import CURRENCY, MICROS_PER_UNIT, format_micros
from backfill.jobs.billing.models import Price, Quota
from backfill.jobs.errors import InvalidRequest, NotFound
from backfill.jobs.models import ApiKey, Batch, File, Team, Upload, UploadPart
from backfill.jobs.webhooks.events import secret_hint
from backfill.jobs.webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent

FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"
UPLOAD_PREFIX = "upload_"
PART_PREFIX = "part_"


@overload
def ts(value: datetime) -> int: ...
@overload
def ts(value: datetime | None) -> int | None: ...
def ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_id_out(raw: str) -> str:
    return FILE_PREFIX + raw


def file_id_in(wire: str, *, param: str = "file_id") -> str:
    if not wire.startswith(FILE_PREFIX) or len(wire) <= len(FILE_PREFIX):
        raise NotFound(f"No such File object: {wire}", param=param)
    return wire[len(FILE_PREFIX) :]


def batch_id_out(raw: str) -> str:
    return BATCH_PREFIX + raw


def batch_id_in(wire: str) -> str:
    if not wire.startswith(BATCH_PREFIX) or len(wire) <= len(BATCH_PREFIX):
        raise NotFound(f"No batch found with id '{wire}'.", param="batch_id")
    return wire[len(BATCH_PREFIX) :]


def upload_id_out(raw: str) -> str:
    return UPLOAD_PREFIX + raw


def upload_id_in(wire: str) -> str:
    if not wire.startswith(UPLOAD_PREFIX) or len(wire) <= len(UPLOAD_PREFIX):
        raise NotFound(f"No such Upload object: {wire}", param="upload_id")
    return wire[len(UPLOAD_PREFIX) :]


def part_ids_in(wires: list[str]) -> list[str]:
    """A part id the service never gave out names no part of the upload: 404, like an unknown one."""
    for wire in wires:
        if not wire.startswith(PART_PREFIX) or len(wire) <= len(PART_PREFIX):
            raise NotFound(f"No such Part object: {wire}", param="part_ids")
    return [wire[len(PART_PREFIX) :] for wire in wires]


def upload_out(row: Upload, *, status: str, file: File | None = None) -> protocol.Upload:
    return protocol.Upload(
        id=upload_id_out(row.id),
        object="upload",
        bytes=row.bytes,
        created_at=ts(row.created_at),
        expires_at=ts(row.expires_at),
        filename=row.filename,
        purpose=row.purpose,
        status=status,  # type: ignore[arg-type]  # an UploadStatus a client sees; pydantic checks it
        file=file_out(file) if file is not None else None,
    )


def part_out(row: UploadPart) -> protocol.UploadPart:
    return protocol.UploadPart(
        id=PART_PREFIX + row.id,
        object="upload.part",
        created_at=ts(row.created_at),
        upload_id=upload_id_out(row.upload_id),
    )


def file_out(row: File) -> protocol.FileObject:
    return protocol.FileObject(
        id=file_id_out(row.id),
        object="file",
        bytes=row.bytes,
        created_at=ts(row.created_at),
        expires_at=ts(row.expires_at),
        filename=row.filename,
        purpose=row.purpose,  # type: ignore[arg-type]  # a str column; pydantic checks it against FilePurpose
        status="processed",
        status_details=None,
    )


def file_deleted_out(row: File) -> protocol.FileDeleted:
    return protocol.FileDeleted(id=file_id_out(row.id), object="file", deleted=True)


def batch_out(b: Batch) -> protocol.Batch:
    return protocol.Batch(
        id=batch_id_out(b.id),
        object="batch",
        endpoint=b.endpoint,
        model=b.model,
        errors=(
            protocol.BatchErrors(object="list", data=[protocol.BatchError.model_validate(e) for e in b.errors])
            if b.errors
            else None
        ),
        input_file_id=file_id_out(b.input_file_id),
        completion_window=b.completion_window,
        status=b.status,
        output_file_id=file_id_out(b.output_file_id) if b.output_file_id else None,
        error_file_id=file_id_out(b.error_file_id) if b.error_file_id else None,
        created_at=ts(b.created_at),
        in_progress_at=ts(b.in_progress_at),
        expires_at=ts(b.expires_at),
        finalizing_at=ts(b.finalizing_at),
        completed_at=ts(b.completed_at),
        failed_at=ts(b.failed_at),
        expired_at=ts(b.expired_at),
        cancelling_at=ts(b.cancelling_at),
        cancelled_at=ts(b.cancelled_at),
        request_counts=protocol.BatchRequestCounts(total=b.total, completed=b.completed, failed=b.failed),
        usage=protocol.BatchUsage(
            input_tokens=b.input_tokens,
            input_tokens_details=protocol.InputTokensDetails(cached_tokens=b.cached_tokens),
            output_tokens=b.output_tokens,
            output_tokens_details=protocol.OutputTokensDetails(reasoning_tokens=b.reasoning_tokens),
            total_tokens=b.input_tokens + b.output_tokens,
        ),
        metadata=b.metadata_,
    )


def file_page(rows: list[File], *, has_more: bool) -> protocol.FileList:
    return protocol.FileList.of([file_out(r) for r in rows], has_more=has_more)


def batch_page(rows: list[Batch], *, has_more: bool) -> protocol.BatchList:
    return protocol.BatchList.of([batch_out(b) for b in rows], has_more=has_more)


# -- Organization: a backfill team is an OpenAI project (`proj_` + team id), key ids get `key_`;
# money leaves as OpenAI's {"value", "currency"} and, for prices, as exact decimal strings.

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


# -- Webhooks

ENDPOINT_PREFIX = "wh_"
DELIVERY_PREFIX = "whd_"
EVENT_PREFIX = "evt_"


def endpoint_id_in(wire: str) -> str:
    if not wire.startswith(ENDPOINT_PREFIX) or len(wire) <= len(ENDPOINT_PREFIX):
        raise NotFound(f"No webhook endpoint found with id '{wire}'.", param="webhook_endpoint_id")
    return wire[len(ENDPOINT_PREFIX) :]


def endpoint_out(e: WebhookEndpoint) -> WebhookEndpointObject:
    return WebhookEndpointObject(
        id=ENDPOINT_PREFIX + e.id,
        object="webhook_endpoint",
        name=e.name,
        url=e.url,
        event_types=list(e.event_types),
        signing_secret_hint=secret_hint(e.secret),
        created_at=ts(e.created_at),
        updated_at=ts(e.updated_at),
    )


def endpoint_with_secret(e: WebhookEndpoint) -> WebhookEndpointWithSecret:
    return WebhookEndpointWithSecret(**endpoint_out(e).model_dump(), signing_secret=e.secret)


def delivery_out(d: WebhookDelivery, event: WebhookEvent) -> WebhookDeliveryObject:
    return WebhookDeliveryObject(
        id=DELIVERY_PREFIX + d.id,
        object="webhook_endpoint.delivery",
        webhook_endpoint_id=ENDPOINT_PREFIX + d.endpoint_id,
        event_id=EVENT_PREFIX + event.id,
        event_type=event.type,
        batch_id=batch_id_out(event.batch_id),
        status=d.status,  # type: ignore[arg-type]  # a str column; pydantic checks it against the Literal
        attempts=d.attempts,
        last_status_code=d.last_status_code,
        last_error=d.last_error,
        last_attempt_at=ts(d.last_attempt_at),
        next_attempt_at=ts(d.next_attempt_at),
        delivered_at=ts(d.delivered_at),
        created_at=ts(d.created_at),
        history=[DeliveryAttempt.model_validate(a) for a in d.history or []],
    )
