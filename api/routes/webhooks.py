"""Webhook endpoints, in the shape of OpenAI's Webhooks API (`/v1/webhook_endpoints`, what the
official SDK's `client.webhooks.create|retrieve|update|list|delete|rotate_secret` call), per team;
plus an extension: an endpoint's delivery log (`GET /v1/webhook_endpoints/{id}/deliveries`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from backfill.api.deps import CurrentPrincipal, DbSession
from backfill.api.errors import COMMON_ERRORS, error_responses
from backfill.api.protocol import (
    CreateEndpointBody,
    ListPage,
    RotateSecretBody,
    UpdateEndpointBody,
    WebhookDeliveryObject,
    WebhookEndpointDeleted,
    WebhookEndpointObject,
    WebhookEndpointWithSecret,
    WebhookEventTypeList,
)
from backfill.api.wire import (
    DELIVERY_PREFIX,
    ENDPOINT_PREFIX,
    delivery_out,
    endpoint_id_in,
    endpoint_out,
    endpoint_with_secret,
)
from backfill.jobs.webhooks.events import (
    EVENT_TYPES,
    create_endpoint,
    delete_endpoint,
    get_endpoint,
    list_deliveries,
    list_endpoints,
    rotate_secret,
    update_endpoint,
)
from backfill.jobs.webhooks.targets import TargetPolicy
from backfill.storage.settings import get_settings

router = APIRouter(prefix="/v1", tags=["webhooks"], responses=error_responses(*COMMON_ERRORS))


@router.post("/webhook_endpoints")
def create_webhook_endpoint(
    body: CreateEndpointBody, principal: CurrentPrincipal, session: DbSession
) -> WebhookEndpointWithSecret:
    endpoint = create_endpoint(
        session,
        team_id=principal.team_id,
        name=body.name,
        url=body.url,
        event_types=body.event_types,
        policy=TargetPolicy.from_settings(get_settings()),
    )
    return endpoint_with_secret(endpoint)


@router.get("/webhook_endpoints")
def list_webhook_endpoints(
    principal: CurrentPrincipal,
    session: DbSession,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListPage[WebhookEndpointObject]:
    rows, has_more = list_endpoints(
        session, team_id=principal.team_id, limit=limit, after=endpoint_id_in(after) if after else None
    )
    return ListPage[WebhookEndpointObject].of([endpoint_out(e) for e in rows], has_more=has_more)


@router.get("/webhook_endpoints/{webhook_endpoint_id}")
def retrieve_webhook_endpoint(
    webhook_endpoint_id: str, principal: CurrentPrincipal, session: DbSession
) -> WebhookEndpointObject:
    return endpoint_out(
        get_endpoint(session, team_id=principal.team_id, endpoint_id=endpoint_id_in(webhook_endpoint_id))
    )


@router.post("/webhook_endpoints/{webhook_endpoint_id}")
def update_webhook_endpoint(
    webhook_endpoint_id: str, body: UpdateEndpointBody, principal: CurrentPrincipal, session: DbSession
) -> WebhookEndpointObject:
    endpoint = update_endpoint(
        session,
        team_id=principal.team_id,
        endpoint_id=endpoint_id_in(webhook_endpoint_id),
        name=body.name,
        url=body.url,
        event_types=body.event_types,
        policy=TargetPolicy.from_settings(get_settings()),
    )
    return endpoint_out(endpoint)


@router.delete("/webhook_endpoints/{webhook_endpoint_id}")
def delete_webhook_endpoint(
    webhook_endpoint_id: str, principal: CurrentPrincipal, session: DbSession
) -> WebhookEndpointDeleted:
    endpoint = delete_endpoint(session, team_id=principal.team_id, endpoint_id=endpoint_id_in(webhook_endpoint_id))
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
        endpoint_id=endpoint_id_in(webhook_endpoint_id),
        keep_old_for_24h=body.keep_old_secret_active_for_24_hours if body else False,
    )
    return endpoint_with_secret(endpoint)


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
        endpoint_id=endpoint_id_in(webhook_endpoint_id),
        limit=limit,
        after=after.removeprefix(DELIVERY_PREFIX) if after else None,
    )
    return ListPage[WebhookDeliveryObject].of([delivery_out(d, e) for d, e in rows], has_more=has_more)
