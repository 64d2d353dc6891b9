"""Batches: creation, reading, listing and cancellation (the status machine's API side)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import select, tuple_, update
from sqlalchemy.orm import Session

from backfill.jobs.billing.ledger import current_price_version, quoted_multiplier
from backfill.jobs.billing.windows import check_window
from backfill.jobs.endpoints import BATCH_ENDPOINTS
from backfill.jobs.errors import Conflict, InvalidRequest, NotFound
from backfill.jobs.files import get_file, validate_expiry
from backfill.jobs.models import Batch, BatchStatus, utcnow

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def validate_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object of string keys and string values.", param="metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed.", param="metadata"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or len(key) > MAX_METADATA_KEY:
            raise InvalidRequest(
                f"metadata keys must be strings of at most {MAX_METADATA_KEY} characters.", param="metadata"
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise InvalidRequest(
                f"metadata['{key}'] must be a string of at most {MAX_METADATA_VALUE} characters.",
                param=f"metadata.{key}",
            )
    return dict(metadata)


def create_batch(
    session: Session,
    *,
    team_id: str,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    windows: dict[str, int],
    metadata: Any = None,
    output_expires_after: dict[str, Any] | None = None,
    api_key_id: str | None = None,
    multipliers: Mapping[str, Decimal],
) -> Batch:
    """A `validating` batch; `api_key_id` is the creating key, which its usage is recorded under.
    It is billed at the prices and the window's multiplier in force now (`multipliers`, by
    default BACKFILL_WINDOW_PRICE_MULTIPLIERS): both are stored on it."""
    if endpoint not in BATCH_ENDPOINTS:
        raise InvalidRequest(
            f"Invalid endpoint {endpoint!r}: backfill supports {', '.join(BATCH_ENDPOINTS)}.", param="endpoint"
        )
    window_s = check_window(completion_window, windows)
    meta = validate_metadata(metadata)
    output_expiry_s = None
    if output_expires_after is not None:
        if not isinstance(output_expires_after, dict):
            raise InvalidRequest("output_expires_after must be an object.", param="output_expires_after")
        seconds = output_expires_after.get("seconds")
        output_expiry_s = validate_expiry(
            output_expires_after.get("anchor"),
            seconds if isinstance(seconds, int) else -1,
            param="output_expires_after",
        )
    source = get_file(session, team_id=team_id, file_id=input_file_id)
    if source.purpose != "batch":
        raise InvalidRequest(
            f"File {input_file_id} has purpose {source.purpose!r}; a batch input needs purpose 'batch'.",
            param="input_file_id",
        )
    now = utcnow()
    batch = Batch(
        team_id=team_id,
        api_key_id=api_key_id,
        input_file_id=source.id,
        endpoint=endpoint,
        completion_window=completion_window,
        status=BatchStatus.validating,
        metadata_=meta,
        output_expires_after_s=output_expiry_s,
        created_at=now,
        expires_at=now + timedelta(seconds=window_s),
        price_version=current_price_version(session),  # billed at the prices in force now
        price_multiplier=quoted_multiplier(completion_window, multipliers),
    )
    session.add(batch)
    session.flush()
    return batch


def get_batch(session: Session, *, team_id: str | None, batch_id: str) -> Batch:
    batch = session.get(Batch, batch_id)
    if batch is None or (team_id is not None and batch.team_id != team_id):
        raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id")
    return batch


def list_batches(session: Session, *, team_id: str | None, limit: int, after: str | None) -> tuple[list[Batch], bool]:
    query = select(Batch)
    if team_id is not None:
        query = query.where(Batch.team_id == team_id)
    if after:
        cursor = get_batch(session, team_id=team_id, batch_id=after)
        query = query.where(tuple_(Batch.created_at, Batch.id) < tuple_(cursor.created_at, cursor.id))
    rows = list(session.execute(query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)).scalars())
    return rows[:limit], len(rows) > limit


def cancel_batch(session: Session, *, team_id: str | None, batch_id: str) -> Batch:
    """Compare-and-set to `cancelling`; the scheduler drains in-flight work and finishes the job."""
    batch = get_batch(session, team_id=team_id, batch_id=batch_id)
    if batch.status != BatchStatus.cancelling:
        _move_to_cancelling(session, batch)
    return batch


def _move_to_cancelling(session: Session, batch: Batch) -> None:
    # The batch row FOR UPDATE first, as expiry does (`jobs.sweeps.expire_overdue`): it waits for
    # the claims in flight (each holds FOR KEY SHARE on the row, `jobs.execution.claims`), so their lines
    # are seen running and drained before finalization. A plain UPDATE does not conflict with
    # FOR KEY SHARE: a line claimed meanwhile ran and was billed after the files were written.
    session.execute(select(Batch.id).where(Batch.id == batch.id).with_for_update())
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch.id, Batch.status.in_([BatchStatus.validating, BatchStatus.in_progress]))
        .values(status=BatchStatus.cancelling, cancelling_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.refresh(batch)  # a racing cancel or finish may have moved it meanwhile
    if result.rowcount == 0 and batch.status != BatchStatus.cancelling:  # type: ignore[attr-defined]
        raise Conflict(f"Cannot cancel a batch with status '{batch.status}'.", param="batch_id")
