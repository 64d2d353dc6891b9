"""Thin Celery tasks: arguments are ids, bodies open a unit of work and call `jobs`.

Registered on the one app in `storage.broker` under its `TaskName`s; a worker imports this
module before it starts (`backfill worker`), so the bodies are known when messages arrive.
"""

from __future__ import annotations

import asyncio
import logging

from jobs import output, validation
from jobs.catalog import get_catalog
from jobs.files import file_key
from jobs.models import Batch, BatchStatus
from scheduler.dispatcher import Dispatcher
from scheduler.fleet import FleetClient
from scheduler.leases import exclusive_lease, get_lease_store
from scheduler.runtime import get_admission, make_planner
from storage.broker import TaskName, celery_app
from storage.db import unit_of_work
from storage.objects import get_object_store
from storage.settings import get_settings

log = logging.getLogger("backfill.tasks")


VALIDATION_LEASE_TTL_S = 30.0


@celery_app.task(name=TaskName.validate_batch.value)
def validate_batch(batch_id: str) -> str:
    """Validate a batch's input once. The scheduler loop's re-nudge is the only retry chain:
    a transient failure (fleet, database or store unreachable) returns and waits for it; a
    second message for a batch whose validation is running finds the lease taken and returns;
    any other failure fails the batch with a clear error instead of retrying forever."""
    s = get_settings()
    with unit_of_work() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status not in (BatchStatus.validating, BatchStatus.cancelling) or batch.total:
            return batch.status if batch else "missing"
        key = file_key(batch.team_id, batch.input_file_id)
        endpoint = batch.endpoint
    with exclusive_lease(get_lease_store(), f"validate:{batch_id}", ttl_s=VALIDATION_LEASE_TTL_S) as mine:
        if not mine:
            return "busy"
        try:
            result = validation.validate_lines(
                get_object_store().open(key),
                endpoint=endpoint,
                served_models=get_catalog().model_ids(),
                limits=validation.Limits(
                    max_requests=s.max_requests_per_batch,
                    max_line_bytes=s.max_line_bytes,
                    max_errors=s.max_reported_errors,
                ),
            )
            with unit_of_work() as session:
                return validation.apply_validation(session, batch_id=batch_id, result=result)
        except Exception as exc:
            reason = validation.validation_failure_message(exc)
            if validation.is_transient_validation_error(exc):
                log.warning("validation of batch %s waits for the scheduler's next nudge: %s", batch_id, reason)
                return "waiting"
            log.exception("validation of batch %s failed", batch_id)
            with unit_of_work() as session:
                return validation.fail_batch_validation(session, batch_id=batch_id, message=reason)


@celery_app.task(name=TaskName.finalize_batch.value)
def finalize_batch(batch_id: str) -> str | None:
    return output.finalize_batch(unit_of_work, get_object_store(), batch_id=batch_id)


@celery_app.task(name=TaskName.drain.value)
def drain() -> int:
    """Release pending lines onto the fleet for one time slice."""
    s = get_settings()
    leases = get_lease_store()

    async def run() -> int:
        fleet = FleetClient(s.fleet_url_list, timeout_s=s.fleet_timeout_s, api_key=s.fleet_api_key)
        try:
            dispatcher = Dispatcher(
                store=get_object_store(),
                leases=leases,
                admission=get_admission(),
                fleet=fleet,
                planner=make_planner(),
                max_attempts=s.fleet_max_retries,
                hint_mode=s.fleet_priority_hint,
            )
            return await dispatcher.run(s.drain_slice_s, max_drains=s.drains)
        finally:
            await fleet.aclose()

    return asyncio.run(run())
