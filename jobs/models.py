"""ORM models. The database is the truth; the broker only nudges.

Ids are bare random tokens; the API adds OpenAI's prefixes (`file-`, `batch_`) at the edge.
"""

from __future__ import annotations

import enum
import secrets
import string
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    false,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapped, mapped_column

from backfill.storage.db import Base

_ALPHABET = string.ascii_letters + string.digits


def column_length(table: type[Base], column: str) -> int:
    """A String column's length, so a check before storing and the table never disagree."""
    kind = table.__table__.c[column].type
    assert isinstance(kind, String) and kind.length is not None
    return kind.length


def new_id(length: int = 24) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(length))


def utcnow() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC on both Postgres and SQLite (which stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class DecimalText(TypeDecorator[Decimal]):
    """An exact decimal kept as its text: Postgres and SQLite read back the very value written
    (SQLite's NUMERIC goes through a float)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Decimal | None, dialect: Dialect) -> str | None:
        return str(value) if value is not None else None

    def process_result_value(self, value: str | None, dialect: Dialect) -> Decimal | None:
        return Decimal(value) if value is not None else None


class BatchStatus(enum.StrEnum):
    validating = "validating"
    failed = "failed"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


# Stored as the enum's value in the VARCHAR(16) column the initial migration made: no native
# database enum and no CHECK constraint, so a new status of up to 16 characters needs no
# migration. Unknown strings are refused on the way in; rows come back as `BatchStatus` members.
_BATCH_STATUS = Enum(
    BatchStatus,
    native_enum=False,
    create_constraint=False,
    length=16,
    validate_strings=True,
    values_callable=lambda statuses: [s.value for s in statuses],
)

TERMINAL_STATUSES = frozenset({BatchStatus.failed, BatchStatus.completed, BatchStatus.expired, BatchStatus.cancelled})
# A batch retention has yet to retire: its ledger not rolled up, or its line rows not deleted
# (the predicate of the partial index `ix_batches_unretired`, migration 0016).
UNRETIRED_SQL = "ledger_rolled_up_at IS NULL OR bodies_purged_at IS NULL"


class RequestState(enum.StrEnum):
    pending = "pending"
    running = "running"
    succeeded = "succeeded"  # fleet answered 2xx: goes to the output file
    failed = "failed"  # fleet answered 4xx, or retries ran out: error file with the fleet's answer
    cancelled = "cancelled"  # batch_cancelled error line
    expired = "expired"  # batch_expired error line


class Team(Base):
    __tablename__ = "teams"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    # Weight in the fair share across teams (2 = twice the share of 1).
    weight: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    prefix: Mapped[str] = mapped_column(String(32), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    # Installed from BACKFILL_BOOTSTRAP_API_KEY / BACKFILL_ADMIN_API_KEY (not its name: free text).
    configured: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Why it was revoked: "rotated" (another key was configured: configuring it again restores
    # it) or "revoked" (by an admin: never undone); None while valid, or revoked before 0010.
    revoked_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)


class File(Base):
    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=new_id)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    object_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    deleted_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    # When retention removed the object (the row stays: batches and the ledger still name it).
    purged_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)

    __table_args__ = (
        Index("ix_files_team_created", "team_id", "created_at", "id"),
        Index("ix_files_object_key", "object_key"),
    )


class Batch(Base):
    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"))
    # The key that created the batch (no foreign key: usage by key outlives a deleted key).
    api_key_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    input_file_id: Mapped[str] = mapped_column(String(40))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[BatchStatus] = mapped_column(_BATCH_STATUS, default=BatchStatus.validating, index=True)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)

    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)

    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)

    # Live counters, bumped in the same transaction that records a request's result.
    total: Mapped[int] = mapped_column(Integer, default=0)
    # Of `total`, the lines whose index rows are still to be written (validation writes a large
    # index in parts, in release order: `jobs.validation.outcome`). The batch runs once its first part
    # is in, and is finalized only once this is 0.
    unindexed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Estimated prompt + max output tokens of the whole batch (quotas, forecasts).
    token_estimate: Mapped[int] = mapped_column(BigInteger, default=0)
    price_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The window's price multiplier (BACKFILL_WINDOW_PRICE_MULTIPLIERS) when the batch was created,
    # applied to the general price row (`jobs.billing.ledger.batch_rates`); NULL (batches older than
    # migration 0012) bills at 1.
    price_multiplier: Mapped[Decimal | None] = mapped_column(DecimalText, nullable=True)
    # When retention removed the batch's line rows from the database (the result files keep them).
    bodies_purged_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    # When the batch's per-line ledger rows were rolled up (`jobs.billing.rollup`).
    ledger_rolled_up_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)

    __table_args__ = (
        Index("ix_batches_team_created", "team_id", "created_at", "id"),
        # What retention has yet to retire (`jobs.retention.batches_to_retire`): retired batches
        # leave it, so a pass reads only the batches left to do, not every batch ever made.
        Index(
            "ix_batches_unretired",
            "status",
            postgresql_where=text(UNRETIRED_SQL),
            sqlite_where=text(UNRETIRED_SQL),
        ),
    )


# The predicates of batch_requests' partial indexes. Queries that need the index say them as
# these SQL literals: compared with a bound parameter, a generic plan cannot prove them.
RUNNING = "state = 'running'"
SERVED = "state IN ('running', 'succeeded', 'failed')"
RUNNING_LINES = text(f"batch_requests.{RUNNING}")
SERVED_LINES = text(f"batch_requests.{SERVED}")


class BatchRequest(Base):
    """One input line: a compact index into the input file plus its execution record."""

    __tablename__ = "batch_requests"
    # No foreign key to batches, and no unique (batch_id, custom_id): validation writes a batch's
    # lines once, under its batch row's lock, after rejecting duplicate ids, and batches are never
    # deleted; a check per line would cost a million-line COPY a third of its time (migration 0008).
    batch_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(512))
    offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(Integer)
    prefix_hash: Mapped[str] = mapped_column(String(16), default="")
    token_estimate: Mapped[int] = mapped_column(Integer, default=0)
    # The line's place in its batch's prefix tree (jobs/execution/prefixes.py): release order, the line to
    # finish first (an agent trace's previous turn), the KV tokens it shares with other lines,
    # and the most KV its work holds (for an agent trace's turn, its session's largest context).
    prefix_rank: Mapped[int] = mapped_column(Integer, default=0)
    after_line: Mapped[int | None] = mapped_column(Integer, nullable=True)
    prefix_tokens: Mapped[int] = mapped_column(Integer, default=0)
    kv_tokens: Mapped[int] = mapped_column(Integer, default=0)

    state: Mapped[str] = mapped_column(String(16), default=RequestState.pending)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    not_before: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    claim_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    claimed_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)

    result_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    response_body: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(Integer, default=0)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)

    __table_args__ = (
        # The dispatcher's pick: pending lines of a batch in prefix-tree order (a claim looks at
        # most jobs.execution.claims.SCAN_LINES into it, so a hot prefix is found there too).
        Index("ix_batch_requests_rank", "batch_id", "state", "prefix_rank", "line"),
        # Whether a prefix was served a while ago (its blocks are cached): only lines that ran.
        Index(
            "ix_batch_requests_served",
            "batch_id",
            "prefix_hash",
            postgresql_where=text(SERVED),
            sqlite_where=text(SERVED),
        ),
        # Running lines by holder (reclaiming a dead drain's lines); pending lines cost it nothing.
        Index(
            "ix_batch_requests_running",
            "claim_token",
            postgresql_where=text(RUNNING),
            sqlite_where=text(RUNNING),
        ),
    )


class UploadStatus(enum.StrEnum):
    pending = "pending"
    completing = "completing"  # a `complete` is assembling the file (shown as pending)
    completed = "completed"
    cancelled = "cancelled"
    expired = "expired"  # set by retention when it removes the parts of an upload never completed


class Upload(Base):
    """A file sent in parts (OpenAI's Uploads API): the parts land in the object store's multipart
    upload at the key of the file it becomes (`file_id`), and completion makes that file."""

    __tablename__ = "uploads"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    mime_type: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)  # what the client said it will send
    status: Mapped[str] = mapped_column(String(16), default=UploadStatus.pending.value)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime)
    # The file's own expiry once completed (`expires_after`), seconds after its creation.
    file_expires_after_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The file the upload becomes; its object key holds the store's multipart upload.
    file_id: Mapped[str] = mapped_column(String(40))
    multipart_key: Mapped[str] = mapped_column(String(512))
    multipart_id: Mapped[str] = mapped_column(Text)
    # Store part numbers handed out so far (each part takes a run of them) and what the parts hold.
    next_part_number: Mapped[int] = mapped_column(Integer, default=1)
    part_count: Mapped[int] = mapped_column(Integer, default=0)
    received_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # The completion in progress: when it took the upload (None once it let go after a failure,
    # so a retry takes over at once) and the parts it named, in order: the store may already
    # hold what they made, so only a completion of the same parts may take it over.
    completing_since: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    completion_part_ids: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)
    # When the parts of an upload that will never complete were removed from the store.
    cleaned_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)

    __table_args__ = (Index("ix_uploads_cleanup", "cleaned_at", "expires_at"),)


class UploadPart(Base):
    """One part of an upload: a run of store parts (numbers `first_number`...) or, when smaller
    than a store part may be in the middle of an object, an object of its own (`object_key`)."""

    __tablename__ = "upload_parts"
    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    upload_id: Mapped[str] = mapped_column(ForeignKey("uploads.id", ondelete="CASCADE"), index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    first_number: Mapped[int] = mapped_column(Integer)
    # The store's tag of each part in the run, in number order; empty for a part kept apart.
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    object_key: Mapped[str | None] = mapped_column(String(512), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utcnow)
