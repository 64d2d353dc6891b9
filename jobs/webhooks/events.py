"""Webhooks: a team's endpoints, the event outbox and the delivery state machine.

Events use OpenAI's names and payload (`batch.completed`, `batch.failed`, `batch.expired`,
`batch.cancelled`; `{"id": "evt_...", "object": "event", "created_at", "type", "data": {"id"}}`)
and are signed per the Standard Webhooks spec (`webhook-id`, `webhook-timestamp`,
`webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`), so OpenAI's SDK
(`client.webhooks.unwrap`) and any Standard Webhooks verifier accept them.

`record_batch_event` is called in the transaction that moves a batch to a terminal status
(the outbox): the event exists exactly when the status change committed. The scheduler's
delivery loop then sends it at least once per endpoint, retrying with capped exponential backoff
for about a day; every attempt is kept on the delivery row, which the team can read.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

import orjson
from sqlalchemy import select, tuple_, update
from sqlalchemy.orm import Session

from backfill.jobs.errors import InvalidRequest, NotFound
from backfill.jobs.models import Batch, BatchStatus, utcnow
from backfill.jobs.webhooks.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint, WebhookEvent
from backfill.jobs.webhooks.targets import TargetPolicy, check_url_target, invalid_url

# Keyed by the status's value: a BatchStatus is the str it stands for.
EVENT_OF_STATUS: dict[str, str] = {
    BatchStatus.completed: "batch.completed",
    BatchStatus.failed: "batch.failed",
    BatchStatus.expired: "batch.expired",
    BatchStatus.cancelled: "batch.cancelled",
}
EVENT_TYPES = tuple(EVENT_OF_STATUS.values())
SECRET_PREFIX = "whsec_"
MAX_ENDPOINTS_PER_TEAM = 16
MAX_URL_CHARS = 2048
MAX_NAME_CHARS = 128
# Backoff: 5 s, 10 s, 20 s ... doubling up to one hour between tries; no new try is scheduled
# past a day after the event (about 30 attempts in all).
FIRST_RETRY_S = 5.0
MAX_RETRY_S = 3600.0
GIVE_UP_AFTER = timedelta(hours=24)
KEEP_OLD_SECRET_FOR = timedelta(hours=24)
HISTORY_KEPT = 20
ERROR_CHARS = 256
# The outgoing payload is a wire format: it names the batch as the API does.
_EVENT_PREFIX, _BATCH_PREFIX = "evt_", "batch_"


# -- Signing (Standard Webhooks) ----------------------------------------------------------------


def new_signing_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, *, msg_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 HMAC-SHA256>` of `msg_id.timestamp.body`, keyed by the secret's decoded bytes."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    digest = hmac.new(key, b"%s.%d.%s" % (msg_id.encode(), timestamp, body), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signature_header(secrets_: Sequence[str], *, msg_id: str, timestamp: int, body: bytes) -> str:
    """One signature per active secret, space-separated: a verifier accepts any that matches."""
    return " ".join(sign(s, msg_id=msg_id, timestamp=timestamp, body=body) for s in secrets_)


def secret_hint(secret: str) -> str:
    return f"{SECRET_PREFIX}****{secret[-4:]}"


def active_secrets(endpoint: WebhookEndpoint, *, now: datetime) -> list[str]:
    keep_old = endpoint.previous_secret and endpoint.previous_secret_until and endpoint.previous_secret_until > now
    return [endpoint.secret, endpoint.previous_secret] if keep_old else [endpoint.secret]  # type: ignore[list-item]


# -- Endpoints ----------------------------------------------------------------------------------


def _check_url(url: str, policy: TargetPolicy) -> str:
    url = url.strip()
    try:
        parts = urlsplit(url)
        hostname, username = parts.hostname, parts.username
    except ValueError:  # a stray bracket, an IPv4 address in brackets
        raise invalid_url() from None
    if (
        len(url) > MAX_URL_CHARS
        or parts.scheme not in ("http", "https")
        or not hostname
        or username is not None
        or any(c.isspace() or not c.isprintable() for c in url)
    ):
        raise InvalidRequest(
            f"'url' must be an http(s) URL of at most {MAX_URL_CHARS} characters, without credentials.", param="url"
        )
    check_url_target(url, policy)
    return url


def _check_event_types(event_types: Sequence[str]) -> list[str]:
    unknown = [t for t in event_types if t not in EVENT_TYPES]
    if not event_types or unknown:
        raise InvalidRequest(
            f"'event_types' must be a non-empty list of {', '.join(EVENT_TYPES)}.", param="event_types"
        )
    return sorted(set(event_types), key=EVENT_TYPES.index)


def _check_name(name: str) -> str:
    if not name.strip() or len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"'name' must be 1 to {MAX_NAME_CHARS} characters.", param="name")
    return name


def create_endpoint(
    session: Session, *, team_id: str, name: str, url: str, event_types: Sequence[str], policy: TargetPolicy
) -> WebhookEndpoint:
    """A new endpoint with a fresh signing secret (the caller shows it once); its URL must be a
    target `policy` allows."""
    held = session.execute(select(WebhookEndpoint.id).where(WebhookEndpoint.team_id == team_id)).all()
    if len(held) >= MAX_ENDPOINTS_PER_TEAM:
        raise InvalidRequest(
            f"A team may have at most {MAX_ENDPOINTS_PER_TEAM} webhook endpoints; delete one first.",
            param="url",
            code="too_many_webhook_endpoints",
        )
    now = utcnow()
    endpoint = WebhookEndpoint(
        team_id=team_id,
        name=_check_name(name),
        url=_check_url(url, policy),
        event_types=_check_event_types(event_types),
        secret=new_signing_secret(),
        created_at=now,
        updated_at=now,
    )
    session.add(endpoint)
    session.flush()
    return endpoint


def get_endpoint(session: Session, *, team_id: str, endpoint_id: str) -> WebhookEndpoint:
    endpoint = session.get(WebhookEndpoint, endpoint_id)
    if endpoint is None or endpoint.team_id != team_id:
        raise NotFound(f"No webhook endpoint found with id '{endpoint_id}'.", param="webhook_endpoint_id")
    return endpoint


def list_endpoints(
    session: Session, *, team_id: str, limit: int, after: str | None
) -> tuple[list[WebhookEndpoint], bool]:
    query = select(WebhookEndpoint).where(WebhookEndpoint.team_id == team_id)
    if after:
        cursor = get_endpoint(session, team_id=team_id, endpoint_id=after)
        query = query.where(
            tuple_(WebhookEndpoint.created_at, WebhookEndpoint.id) < tuple_(cursor.created_at, cursor.id)
        )
    order = (WebhookEndpoint.created_at.desc(), WebhookEndpoint.id.desc())
    rows = list(session.execute(query.order_by(*order).limit(limit + 1)).scalars())
    return rows[:limit], len(rows) > limit


def update_endpoint(
    session: Session,
    *,
    team_id: str,
    endpoint_id: str,
    name: str | None = None,
    url: str | None = None,
    event_types: Sequence[str] | None = None,
    policy: TargetPolicy,
) -> WebhookEndpoint:
    endpoint = get_endpoint(session, team_id=team_id, endpoint_id=endpoint_id)
    changes = {
        "name": _check_name(name) if name is not None else endpoint.name,
        "url": _check_url(url, policy) if url is not None else endpoint.url,
        "event_types": _check_event_types(event_types) if event_types is not None else endpoint.event_types,
    }
    if any(getattr(endpoint, field) != value for field, value in changes.items()):
        for field, value in changes.items():
            setattr(endpoint, field, value)
        endpoint.updated_at = utcnow()  # an unchanged update does not advance it (as OpenAI's)
    session.flush()
    return endpoint


def delete_endpoint(session: Session, *, team_id: str, endpoint_id: str) -> WebhookEndpoint:
    """Deletes the endpoint and, with it, its delivery log and anything still to deliver."""
    endpoint = get_endpoint(session, team_id=team_id, endpoint_id=endpoint_id)
    session.delete(endpoint)
    session.flush()
    return endpoint


def rotate_secret(session: Session, *, team_id: str, endpoint_id: str, keep_old_for_24h: bool) -> WebhookEndpoint:
    endpoint = get_endpoint(session, team_id=team_id, endpoint_id=endpoint_id)
    now = utcnow()
    endpoint.previous_secret = endpoint.secret if keep_old_for_24h else None
    endpoint.previous_secret_until = now + KEEP_OLD_SECRET_FOR if keep_old_for_24h else None
    endpoint.secret = new_signing_secret()
    endpoint.updated_at = now
    session.flush()
    return endpoint


# -- The outbox ---------------------------------------------------------------------------------


def event_id(batch_id: str, event_type: str) -> str:
    return hashlib.blake2b(f"{batch_id}:{event_type}".encode(), digest_size=12).hexdigest()


def event_body(*, wire_id: str, event_type: str, created_at: datetime, batch_id: str) -> bytes:
    return orjson.dumps(
        {
            "id": wire_id,
            "object": "event",
            "created_at": int(created_at.timestamp()),
            "type": event_type,
            "data": {"id": _BATCH_PREFIX + batch_id},
        }
    )


def record_batch_event(session: Session, *, batch_id: str, status: str) -> WebhookEvent | None:
    """Record the event of a batch's terminal status, with a delivery for each subscribed
    endpoint of its team. Call it in the transaction that changes the status. Idempotent; a
    team with no endpoint for this event gets no row at all."""
    event_type = EVENT_OF_STATUS.get(status)
    team_id = session.execute(select(Batch.team_id).where(Batch.id == batch_id)).scalar_one_or_none()
    if event_type is None or team_id is None:
        return None
    endpoints = [
        e
        for e in session.execute(select(WebhookEndpoint).where(WebhookEndpoint.team_id == team_id)).scalars()
        if event_type in e.event_types
    ]
    raw_id = event_id(batch_id, event_type)
    if not endpoints or session.get(WebhookEvent, raw_id) is not None:
        return None
    now = utcnow()
    body = event_body(wire_id=_EVENT_PREFIX + raw_id, event_type=event_type, created_at=now, batch_id=batch_id)
    event = WebhookEvent(
        id=raw_id, team_id=team_id, type=event_type, batch_id=batch_id, body=body.decode(), created_at=now
    )
    session.add(event)
    session.flush()  # the deliveries' foreign key needs the event row first
    for endpoint in endpoints:
        session.add(WebhookDelivery(event_id=raw_id, endpoint_id=endpoint.id, next_attempt_at=now, created_at=now))
    session.flush()
    return event


# -- Delivery -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DueDelivery:
    """What a sender needs for one attempt, read when the delivery was claimed."""

    delivery_id: str
    attempt: int  # the attempt number this is (1 for the first)
    url: str
    msg_id: str  # the event's wire id: the same on every retry, so receivers can deduplicate
    body: bytes
    secrets: tuple[str, ...]


def claim_due(
    session: Session, *, now: datetime | None = None, limit: int = 32, hold_s: float = 60.0
) -> list[DueDelivery]:
    """Take up to `limit` due deliveries for one attempt each: their next attempt moves `hold_s`
    ahead, so a sender that dies mid-attempt leaves them to be tried again then. Rows another
    sender holds locked are skipped (Postgres)."""
    now = now or utcnow()
    rows = session.execute(
        select(WebhookDelivery, WebhookEndpoint, WebhookEvent)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.status == DeliveryStatus.pending, WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
        .with_for_update(of=WebhookDelivery, skip_locked=True)
    ).all()
    due = []
    for delivery, endpoint, event in rows:
        delivery.next_attempt_at = now + timedelta(seconds=hold_s)
        due.append(
            DueDelivery(
                delivery_id=delivery.id,
                attempt=delivery.attempts + 1,
                url=endpoint.url,
                msg_id=_EVENT_PREFIX + event.id,
                body=event.body.encode(),
                secrets=tuple(active_secrets(endpoint, now=now)),
            )
        )
    session.flush()
    return due


def retry_delay_s(attempts: int) -> float:
    """Seconds before the next try after `attempts` failed ones: doubling from 5 s, capped at an
    hour, with a little jitter so endpoints that failed together are not retried together."""
    base = min(FIRST_RETRY_S * 2.0 ** max(0, min(attempts - 1, 30)), MAX_RETRY_S)
    return base * random.uniform(1.0, 1.1)


def record_attempt(
    session: Session,
    *,
    due: DueDelivery,
    status_code: int | None,
    error: str | None,
    now: datetime | None = None,
) -> str | None:
    """Record one attempt's outcome; returns the delivery's status afterwards (None if it is gone
    or another sender already recorded this attempt)."""
    now = now or utcnow()
    row = session.execute(
        select(WebhookDelivery, WebhookEvent.created_at)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.id == due.delivery_id)
        .with_for_update(of=WebhookDelivery)
    ).first()
    if row is None or row[0].attempts != due.attempt - 1 or row[0].status != DeliveryStatus.pending:
        return None
    delivery, event_created = row
    ok = status_code is not None and 200 <= status_code < 300
    error = error[:ERROR_CHARS] if error else None
    entry = {"at": int(now.timestamp()), "status_code": status_code, "error": error}
    values: dict[str, object] = {
        "attempts": due.attempt,
        "last_attempt_at": now,
        "last_status_code": status_code,
        "last_error": error,
        "history": [*(delivery.history or []), entry][-HISTORY_KEPT:],
    }
    if ok:
        values.update(status=DeliveryStatus.delivered, delivered_at=now, next_attempt_at=None)
    else:
        next_at = now + timedelta(seconds=retry_delay_s(due.attempt))
        if next_at - event_created > GIVE_UP_AFTER:
            values.update(status=DeliveryStatus.failed, next_attempt_at=None)
        else:
            values.update(next_attempt_at=next_at)
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == due.delivery_id)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return str(values.get("status", DeliveryStatus.pending))


def list_deliveries(
    session: Session, *, team_id: str, endpoint_id: str, limit: int, after: str | None
) -> tuple[list[tuple[WebhookDelivery, WebhookEvent]], bool]:
    """An endpoint's delivery log, newest first."""
    get_endpoint(session, team_id=team_id, endpoint_id=endpoint_id)
    query = (
        select(WebhookDelivery, WebhookEvent)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.endpoint_id == endpoint_id)
    )
    if after:
        cursor = session.get(WebhookDelivery, after)
        if cursor is None or cursor.endpoint_id != endpoint_id:
            raise NotFound(f"No delivery found with id '{after}'.", param="after")
        query = query.where(
            tuple_(WebhookDelivery.created_at, WebhookDelivery.id) < tuple_(cursor.created_at, cursor.id)
        )
    order = (WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc())
    rows = [(d, e) for d, e in session.execute(query.order_by(*order).limit(limit + 1)).all()]
    return rows[:limit], len(rows) > limit
