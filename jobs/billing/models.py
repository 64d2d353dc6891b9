"""Billing tables: versioned prices, the usage ledger, per-team quotas.

Money is integer micro-units of currency (1 USD = 1_000_000 micros) everywhere below the API
edge; prices are micro-units per million tokens. No floats touch an amount.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backfill.jobs.models import UtcDateTime, utcnow
from backfill.storage.db import Base

# SQLite only auto-increments an INTEGER PRIMARY KEY; Postgres gets a 64-bit identity.
_BigId = BigInteger().with_variant(Integer(), "sqlite")


class Price(Base):
    """One price version for a model. Rows are append-only: a change is a new row (a new version),
    so a batch billed at version N is billed the same way forever."""

    __tablename__ = "prices"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(256))
    # None: every completion window; a value ("7d") overrides the general price for that window.
    completion_window: Mapped[str | None] = mapped_column(String(16), nullable=True)
    input_micros_per_million: Mapped[int] = mapped_column(BigInteger)
    cached_input_micros_per_million: Mapped[int] = mapped_column(BigInteger)
    output_micros_per_million: Mapped[int] = mapped_column(BigInteger)
    batch_discount_percent: Mapped[int] = mapped_column(Integer, default=50)
    effective_from: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)

    __table_args__ = (Index("ix_prices_model_effective", "model", "effective_from"),)


# A ledger entry's amounts: what a roll-up sums and what each recorded line carries.
LEDGER_AMOUNTS = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "input_cost_micros",
    "cached_input_cost_micros",
    "output_cost_micros",
    "cost_micros",
)


class UsageLedgerEntry(Base):
    """One row per executed (succeeded) request, written in the transaction that records its result;
    once the batch ends, its rows are rolled up into one per minute, key, model and price
    (`requests` lines each, with a negative `line`: `jobs.billing.rollup`).

    No cascades: a billing record outlives whatever it refers to.
    """

    __tablename__ = "usage_ledger"
    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"))
    line: Mapped[int] = mapped_column(Integer)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id"))
    # The batch's creating key (OpenAI's usage `group_by=api_key_id`); None before it was recorded.
    api_key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    model: Mapped[str] = mapped_column(String(256))
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # The price row used; None when the model had no price in force (billed at zero, tokens still counted).
    price_version: Mapped[int | None] = mapped_column(ForeignKey("prices.id"), nullable=True)
    input_cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_input_cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    output_cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    recorded_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    # How many billed lines the row stands for: 1, or a rollup's count.
    requests: Mapped[int] = mapped_column(BigInteger, default=1, server_default="1")

    __table_args__ = (
        # The ledger's idempotency: a request is billed at most once, whatever runs twice.
        UniqueConstraint("batch_id", "line", name="uq_usage_ledger_request"),
        Index("ix_usage_ledger_team_recorded", "team_id", "recorded_at"),
        Index("ix_usage_ledger_recorded", "recorded_at"),
    )


class Quota(Base):
    """Caps for one team and model; a missing row or a None field means no cap."""

    __tablename__ = "quotas"
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    max_enqueued_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_concurrent_batches: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow, onupdate=utcnow)
