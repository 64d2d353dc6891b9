"""Validation of a batch input file, as the validation task runs it: the file checked
(`jobs.validation.scan`), the outcome recorded on the batch (`apply_validation`), and a valid
batch's request index written (`jobs.validation.request_index`), its first part with the batch's move to
in_progress and the rest in parts after (`write_index_parts`).

Valid batches get a compact request index (`jobs.validation.request_index`) instead of one queue message
per line. Nothing a user can write makes validation raise; an unexpected failure ends the batch
through `fail_batch_validation` instead of retrying it until it expires.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, select, update
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from backfill.jobs.billing.quotas import quota_errors
from backfill.jobs.errors import batch_error
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, utcnow
from backfill.jobs.validation.lines import INT64_MAX
from backfill.jobs.validation.request_index import RequestIndex, write_index
from backfill.jobs.validation.scan import (
    ValidationResult,
)
from backfill.jobs.webhooks.events import record_batch_event
from backfill.storage.db import UnitOfWork
from backfill.storage.db import is_transient as is_transient_database_error
from backfill.storage.fleet_models import FleetUnavailable
from backfill.storage.objects import is_transient as is_transient_object_store_error

# iter_lines, max_output_tokens and prompt_text are also read by the CLI's local estimate.


log = logging.getLogger("backfill.validation")

VALIDATION_FAILED_CODE = "validation_failed"
# Index rows written with the batch's move to in_progress, then per transaction after it: enough
# for the drains' first minutes, and a part a fraction of a second of COPY.
FIRST_INDEX_PART = 20_000
INDEX_PART = 50_000


def apply_validation(session: Session, *, batch_id: str, result: ValidationResult) -> str:
    """Record the outcome on a batch still validating: `failed` with the file's errors, else its
    index's first part and `in_progress`. Idempotent: a redelivered validation replaces its own
    earlier index.

    A batch cancelled meanwhile gets nothing (its status is returned): none of its lines will
    run, so it ends `cancelled` with no lines, as one cancelled before validation started
    (finalized once settled: `jobs.sweeps.sweep_cancelling`)."""
    # FOR UPDATE: a cancel waits for this transaction, so it finds the batch validated or not.
    batch = session.get(Batch, batch_id, with_for_update=True)
    if batch is None or batch.status != BatchStatus.validating:
        return batch.status if batch else "missing"
    now = utcnow()
    token_estimate = min(result.token_estimate, INT64_MAX)
    if not result.errors and result.model is not None:
        # Over quota fails like any validation error: no request index, so nothing is dispatched.
        result.errors.extend(
            quota_errors(
                session,
                team_id=batch.team_id,
                model=result.model,
                batch_id=batch_id,
                token_estimate=token_estimate,
            )
        )
    if result.errors:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status == BatchStatus.validating)
            .values(status=BatchStatus.failed, failed_at=now, errors=result.errors, model=result.model)
        )
        record_batch_event(session, batch_id=batch_id, status=BatchStatus.failed)  # the webhook outbox
        return BatchStatus.failed
    session.execute(delete(BatchRequest).where(BatchRequest.batch_id == batch_id))
    # The first part of the index now, the rest by `write_index_parts` in transactions of their
    # own: the batch runs from its first lines while the rest are written.
    first = min(len(result.requests), FIRST_INDEX_PART)
    write_index(session, batch_id=batch_id, requests=result.requests, ranks=range(first))
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(
            model=result.model,
            total=len(result.requests),
            unindexed=len(result.requests) - first,
            token_estimate=token_estimate,
            status=BatchStatus.in_progress,
            in_progress_at=now,
        )
    )
    return BatchStatus.in_progress


def write_index_parts(units: UnitOfWork, *, batch_id: str, requests: RequestIndex) -> int:
    """Write the index rows `apply_validation` left, INDEX_PART rows in release order per
    transaction, each committed with the batch's `unindexed` count. Resumable and idempotent: a
    part starts where the count says (a validation killed midway is picked up by the next,
    which scans the file again and continues), so no row is written twice. Returns how many
    rows are written in all (the batch's `total` once done).

    Each part first looks at the batch: one cancelled gets no more parts (`end_cancelled_index`)."""
    while True:
        with units() as session:
            # FOR NO KEY UPDATE: claims (FOR KEY SHARE) go on; an expiry (FOR UPDATE) and a
            # cancel (FOR NO KEY UPDATE) wait, so neither lands between this look and the part.
            batch = session.execute(
                select(Batch.total, Batch.unindexed, Batch.status)
                .where(Batch.id == batch_id)
                .with_for_update(key_share=True)
            ).one_or_none()
            if batch is None:
                return 0
            total, unindexed = int(batch.total), int(batch.unindexed)
            if batch.status == BatchStatus.cancelling:
                end_cancelled_index(session, batch_id=batch_id)
                return total - unindexed
            if total != len(requests):  # not this index (or none to write)
                log.error(
                    "batch %s: index of %d lines does not match its %d; not written", batch_id, len(requests), total
                )
                return total - unindexed
            start = total - unindexed
            if start >= total:
                return start
            end = min(start + INDEX_PART, total)
            write_index(session, batch_id=batch_id, requests=requests, ranks=range(start, end))
            session.execute(update(Batch).where(Batch.id == batch_id).values(unindexed=total - end))


def end_cancelled_index(session: Session, *, batch_id: str) -> None:
    """A batch cancelled while its index is written keeps the lines written so far (its `total`
    becomes them) and gets no more: none of its lines will run again, and finalization, which
    waits for the last line to be indexed, can then write those as cancelled. Nothing for a
    batch not cancelling, or with its index all written."""
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status == BatchStatus.cancelling, Batch.unindexed > 0)
        .values(total=Batch.total - Batch.unindexed, unindexed=0)
        .execution_options(synchronize_session=False)
    )


def fail_batch_validation(session: Session, *, batch_id: str, message: str) -> str:
    """Move a batch still validating to `failed` with one batch-level error; returns its status.

    Compare-and-set on the status, so it is idempotent and never touches a batch that has
    moved on (validated, cancelled, expired); a cancelling batch is ended by finalization.
    """
    moved = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status == BatchStatus.validating)
        .values(status=BatchStatus.failed, failed_at=utcnow(), errors=[batch_error(VALIDATION_FAILED_CODE, message)])
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount:  # type: ignore[attr-defined]
        record_batch_event(session, batch_id=batch_id, status=BatchStatus.failed)  # the webhook outbox
        return BatchStatus.failed
    status = session.execute(select(Batch.status).where(Batch.id == batch_id)).scalar_one_or_none()
    return status if status is not None else "missing"


def is_transient_validation_error(exc: BaseException) -> bool:
    """Whether retrying validation later may succeed: the fleet's model list, the database or
    the object store being unreachable for a while. Anything else fails the batch."""
    if isinstance(exc, FleetUnavailable | PoolTimeout | ConnectionError | TimeoutError):
        return True
    return is_transient_database_error(exc) or is_transient_object_store_error(exc)


def validation_failure_message(exc: BaseException) -> str:
    """What the user reads when validation ended in a permanent failure (no internals leaked)."""
    if isinstance(exc, FileNotFoundError):
        return "The input file could not be read: it no longer exists."
    if is_transient_validation_error(exc):
        return "The input file could not be validated: a service it needs stayed unavailable. Please try again."
    return (
        f"The input file could not be validated because of an internal error ({type(exc).__name__}). Please try again."
    )
