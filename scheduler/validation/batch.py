"""Validating a batch, the use case: check its input file once (on several processes when it is
large), record the outcome, write its request index, and start a drain for its first lines.

The scheduler loop's re-nudge is the only retry chain: a transient failure (fleet, database or
store unreachable) returns and waits for it; a second message for a batch whose validation is
running finds the lease taken and returns; any other failure fails the batch with a clear error
instead of retrying forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from backfill.jobs.files import file_key, stored_size
from backfill.jobs.models import TERMINAL_STATUSES, Batch, BatchStatus
from backfill.jobs.validation import outcome as validation
from backfill.jobs.validation.scan import Limits
from backfill.scheduler.validation.pool import default_processes, validate_object
from backfill.storage.db import unit_of_work
from backfill.storage.fleet_models import get_catalog
from backfill.storage.leases import exclusive_lease, get_lease_store
from backfill.storage.objects import get_object_store
from backfill.storage.settings import Settings

log = logging.getLogger("backfill.tasks")

VALIDATION_LEASE_TTL_S = 30.0


def validate_batch(batch_id: str, s: Settings, *, start_drain: Callable[[str], None]) -> str:
    """Validate batch `batch_id`; `start_drain` nudges a drain once lines can run. Returns what
    happened (the batch's status, or busy, missing, waiting, resumed)."""
    """Validate a batch's input once. The scheduler loop's re-nudge is the only retry chain:
    a transient failure (fleet, database or store unreachable) returns and waits for it; a
    second message for a batch whose validation is running finds the lease taken and returns;
    any other failure fails the batch with a clear error instead of retrying forever."""
    with unit_of_work() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return "missing"
        if batch.status == BatchStatus.cancelling:
            # None of its lines will run: its file is not checked, and an index being written
            # stops where it is (it ends `cancelled` once finalized).
            validation.end_cancelled_index(session, batch_id=batch_id)
            return batch.status
        # Validated already, but its index not all written (the validation that wrote its
        # first part stopped): scan again and write the rest.
        resume = batch.unindexed > 0 and batch.status not in TERMINAL_STATUSES
        if not resume and (batch.status != BatchStatus.validating or batch.total):
            return batch.status
        key = file_key(batch.team_id, batch.input_file_id)
        endpoint = batch.endpoint
        size = stored_size(session, batch.input_file_id)
    with exclusive_lease(get_lease_store(), f"validate:{batch_id}", ttl_s=VALIDATION_LEASE_TTL_S) as mine:
        if not mine:
            return "busy"
        try:
            result = validate_object(
                get_object_store,
                key,
                size,
                processes=s.validation_processes or default_processes(),
                endpoint=endpoint,
                # (A resumed batch's model was checked when it was validated.)
                served_models=None if resume else get_catalog().model_ids(),
                limits=Limits(
                    max_requests=s.max_requests_per_batch,
                    max_line_bytes=s.max_line_bytes,
                    max_errors=s.max_reported_errors,
                ),
            )
            written = time.monotonic()
            if resume:
                status = "resumed"
            else:
                with unit_of_work() as session:
                    status = validation.apply_validation(session, batch_id=batch_id, result=result)
            started = time.monotonic()
            if status != BatchStatus.failed:
                # Its first lines can run now: a drain is started at once rather than at the
                # scheduler's next tick (a surplus one waits briefly for a slot: `Dispatcher.run`).
                start_drain(batch_id)
                validation.write_index_parts(unit_of_work, batch_id=batch_id, requests=result.requests)
                if len(result.requests) > validation.FIRST_INDEX_PART:
                    start_drain(batch_id)  # the rest of its lines, for drains that ran out meanwhile
            log.info(
                "validation of batch %s: %s in %.1f s; the rest of its index of %d lines written in %.1f s",
                batch_id,
                status,
                started - written,
                len(result.requests),
                time.monotonic() - started,
            )
            return str(status)
        except Exception as exc:
            reason = validation.validation_failure_message(exc)
            if validation.is_transient_validation_error(exc):
                log.warning("validation of batch %s waits for the scheduler's next nudge: %s", batch_id, reason)
                return "waiting"
            log.exception("validation of batch %s failed", batch_id)
            with unit_of_work() as session:
                return validation.fail_batch_validation(session, batch_id=batch_id, message=reason)
