"""ORM models of webhooks: a team's endpoints, the event outbox and the delivery log.

An event row is written in the same transaction as the batch's terminal status (a
transactional outbox), with one delivery row per subscribed endpoint; the scheduler's delivery
loop sends what is due and records every attempt on the delivery row.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backfill.jobs.models import UtcDateTime, new_id, utcnow
from backfill.storage.db import Base


class DeliveryStatus(enum.StrEnum):
    pending = "pending"  # not yet delivered; next_attempt_at says when it is tried (again)
    delivered = "delivered"  # the endpoint answered 2xx
    failed = "failed"  # retries ran out (about a day of backoff): no further attempt


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    url: Mapped[str] = mapped_column(String(2048))
    event_types: Mapped[list[str]] = mapped_column(JSON)
    # `whsec_` + base64 of 32 random bytes. Kept as is: signing needs the secret itself.
    secret: Mapped[str] = mapped_column(String(64))
    # After a rotation that keeps the old secret for a day, deliveries carry both signatures.
    previous_secret: Mapped[str | None] = mapped_column(String(64), nullable=True)
    previous_secret_until: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)

    __table_args__ = (Index("ix_webhook_endpoints_team_created", "team_id", "created_at", "id"),)


class WebhookEvent(Base):
    """One event, as the exact body every delivery of it sends (so retries are byte-identical)."""

    __tablename__ = "webhook_events"
    # Derived from the batch id and the event type: recording the same event twice is a no-op.
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(32))
    batch_id: Mapped[str] = mapped_column(String(32), index=True)
    body: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)


class WebhookDelivery(Base):
    """One event to one endpoint, with its attempts: the delivery log a team reads."""

    __tablename__ = "webhook_deliveries"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), default=DeliveryStatus.pending)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # When the next attempt is due; also pushed ahead while a sender holds the delivery, so a
    # sender that dies mid-attempt only delays it (at least once, never lost).
    next_attempt_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    last_attempt_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # The most recent attempts, capped: [{"at": unix seconds, "status_code": int | None, "error": str | None}].
    history: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)

    __table_args__ = (
        UniqueConstraint("event_id", "endpoint_id", name="uq_webhook_deliveries_event_endpoint"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_endpoint_created", "endpoint_id", "created_at", "id"),
    )
