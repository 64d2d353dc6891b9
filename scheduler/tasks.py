"""Thin Celery tasks: arguments are ids, bodies open a unit of work and call `jobs`."""

from __future__ import annotations

import asyncio
import logging

from jobs import output, validation
from jobs.catalog import FleetUnavailable, get_catalog
from jobs.files import file_key
from jobs.models import Batch
from scheduler.celery_app import celery_app
from scheduler.dispatcher import Dispatcher
from scheduler.fleet import FleetClient
from scheduler.leases import get_lease_store
from scheduler.runtime import get_admission, make_planner
from storage.db import unit_of_work
from storage.objects import get_object_store
from storage.settings import get_settings

log = logging.getLogger("backfill.tasks")


@celery_app.task(name="backfill.validate_batch", bind=True, max_retries=None)
def validate_batch(self, batch_id: str) -> str:  # type: ignore[no-untyped-def]
    s = get_settings()
    with unit_of_work() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status not in ("validating", "cancelling") or batch.total:
            return batch.status if batch else "missing"
        key = file_key(batch.team_id, batch.input_file_id)
        endpoint = batch.endpoint
    try:
        served = get_catalog().model_ids()
    except FleetUnavailable as exc:
        raise self.retry(exc=exc, countdown=5) from exc
    result = validation.validate_lines(
        get_object_store().open(key),
        endpoint=endpoint,
        served_models=served,
        limits=validation.Limits(
            max_requests=s.max_requests_per_batch,
            max_line_bytes=s.max_line_bytes,
            max_errors=s.max_reported_errors,
        ),
    )
    with unit_of_work() as session:
        return validation.apply_validation(session, batch_id=batch_id, result=result)


@celery_app.task(name="backfill.finalize_batch")
def finalize_batch(batch_id: str) -> str | None:
    with unit_of_work() as session:
        return output.finalize_batch(session, get_object_store(), batch_id=batch_id)


@celery_app.task(name="backfill.drain")
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
