"""Webhook endpoints, in the shape of OpenAI's Webhooks API (`/v1/webhook_endpoints`, what the
official SDK's `client.webhooks.create|retrieve|update|list|delete|rotate_secret` call), per team;
plus an extension: an endpoint's delivery log (`GET /v1/webhook_endpoints/{id}/deliveries`)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from backfill.api.deps import CurrentPrincipal, DbSession
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import ListPage
from backfill.api.wire import batch_id_out, ts
from backfill.jobs.errors import NotFound
from backfill.jobs.webhooks.events import (
    EVENT_TYPES,
    MAX_NAME_CHARS,
    MAX_URL_CHARS,
    create_endpoint,
    delete_endpoint,
    get_endpoint,
    list_deliveries,
    list_endpoints,
    rotate_secret,
    secret_hint,
    update_endpoint,
)
from backfill.jobs.webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent

router = APIRouter(prefix="/v1", tags=["webhooks"], responses=error_responses(*COMMON_ERRORS))

ENDPOINT_PREFIX = "wh_"
DELIVERY_PREFIX = "whd_"
EVENT_PREFIX = "evt_"
EventType = Literal["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"]
    name: str
    url: str
    event_types: list[str]
    signing_secret_hint: str | None = None
    created_at: int
    updated_at: int | None = None


class WebhookEndpointWithSecret(WebhookEndpointObject):
    """Returned on creation and rotation only: the one time the signing secret is shown."""

    signing_secret: str


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"]
    deleted: bool


class WebhookEventTypeList(BaseModel):
    object: Literal["list"]
    data: list[str]


class DeliveryAttempt(BaseModel):
    at: int
    status_code: int | None
    error: str | None


class WebhookDeliveryObject(BaseModel):
    """One event to one endpoint: where its delivery stands and its recent attempts."""

    id: str
    object: Literal["webhook_endpoint.delivery"]
    webhook_endpoint_id: str
    event_id: str
    event_type: str
    batch_id: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None
    last_error: str | None
    last_attempt_at: int | None
    next_attempt_at: int | None
    delivered_at: int | None
    created_at: int
    history: list[DeliveryAttempt]


class CreateEndpointBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    url: str = Field(min_length=1, max_length=MAX_URL_CHARS)
    event_types: list[EventType] = Field(min_length=1, max_length=len(EVENT_TYPES))


class UpdateEndpointBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    url: str | None = Field(default=None, min_length=1, max_length=MAX_URL_CHARS)
    event_types: list[EventType] | None = Field(default=None, min_length=1, max_length=len(EVENT_TYPES))


class RotateSecretBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keep_old_secret_active_for_24_hours: bool = False


def _endpoint_id_in(wire: str) -> str:
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


def _with_secret(e: WebhookEndpoint) -> WebhookEndpointWithSecret:
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


@router.post("/webhook_endpoints")
def create_webhook_endpoint(
    body: CreateEndpointBody, principal: CurrentPrincipal, session: DbSession
) -> WebhookEndpointWithSecret:
    endpoint = create_endpoint(
        session, team_id=principal.team_id, name=body.name, url=body.url, event_types=body.event_types
    )
    return _with_secret(endpoint)


@router.get("/webhook_endpoints")
def list_webhook_endpoints(
    principal: CurrentPrincipal,
    session: DbSession,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage[WebhookEndpointObject]:
    rows, has_more = list_endpoints(
        session, team_id=principal.team_id, limit=limit, after=_endpoint_id_in(after) if after else None
    )
    return ListPage[WebhookEndpointObject].of([endpoint_out(e) for e in rows], has_more=has_more)


@router.get("/webhook_endpoints/{webhook_endpoint_id}")
def retrieve_webhook_endpoint(
    webhook_endpoint_id: str, principal: CurrentPrincipal, session: DbSession
) -> WebhookEndpointObject:
    return endpoint_out(
        get_endpoint(session, team_id=principal.team_id, endpoint_id=_endpoint_id_in(webhook_endpoint_id))
    )


@router.post("/webhook_endpoints/{webhook_endpoint_id}")
def update_webhook_endpoint(
    webhook_endpoint_id: str, body: UpdateEndpointBody, principal: CurrentPrincipal, session: DbSession
) -> WebhookEndpointObject:
    endpoint = update_endpoint(
        session,
        team_id=principal.team_id,
        endpoint_id=_endpoint_id_in(webhook_endpoint_id),
        name=body.name,
        url=body.url,
        event_types=body.event_types,
    )
    return endpoint_out(endpoint)


@router.delete("/webhook_endpoints/{webhook_endpoint_id}")
def delete_webhook_endpoint(
    webhook_endpoint_id: str, principal: CurrentPrincipal, session: DbSession
) -> WebhookEndpointDeleted:
    endpoint = delete_endpoint(session, team_id=principal.team_id, endpoint_id=_endpoint_id_in(webhook_endpoint_id))
    return WebhookEndpointDeleted(id=ENDPOINT_PREFIX + endpoint.id, object="webhook_endpoint.deleted", deleted=True)


@router.post("/webhook_endpoints/{webhook_endpoint_id}/rotate_secret")
def rotate_webhook_secret(
    webhook_endpoint_id: str,
    principal: CurrentPrincipal,
    session: DbSession,
    body: RotateSecretBody | None = None,
) -> WebhookEndpointWithSecret:
    endpoint = rotate_secret(
        session,
        team_id=principal.team_id,
        endpoint_id=_endpoint_id_in(webhook_endpoint_id),
        keep_old_for_24h=body.keep_old_secret_active_for_24_hours if body else False,
    )
    return _with_secret(endpoint)


@router.get("/webhook_event_types")
def list_webhook_event_types(principal: CurrentPrincipal) -> WebhookEventTypeList:
    return WebhookEventTypeList(object="list", data=list(EVENT_TYPES))


@router.get("/webhook_endpoints/{webhook_endpoint_id}/deliveries")
def list_webhook_deliveries(
    webhook_endpoint_id: str,
    principal: CurrentPrincipal,
    session: DbSession,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage[WebhookDeliveryObject]:
    """Extension: the delivery log of one endpoint, newest first."""
    rows, has_more = list_deliveries(
        session,
        team_id=principal.team_id,
        endpoint_id=_endpoint_id_in(webhook_endpoint_id),
        limit=limit,
        after=after.removeprefix(DELIVERY_PREFIX) if after else None,
    )
    return ListPage[WebhookDeliveryObject].of([delivery_out(d, e) for d, e in rows], has_more=has_more)
