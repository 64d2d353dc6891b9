"""Thin Celery tasks: arguments are ids, bodies open a unit of work and call `jobs`.

Registered on the one app in `storage.broker` under its `TaskName`s; a worker imports this
module before it starts (`backfill worker`), so the bodies are known when messages arrive.

Shutdown: Celery's main process answers SIGTERM with a warm shutdown (it stops taking
messages and waits for the running tasks). A drain would run out its slice and wait for every
request in flight, so it is told: a pool child that gets SIGTERM (sent to the whole process
group) or STOP_SIGNAL (passed on by the main process when only it was signalled) sets
`SHUTDOWN`, and the drain running there stops claiming at once and ends within `drain_grace_s`.
An idle child exits on SIGTERM, as before; a second SIGTERM ends a busy child at once.

billiard installs its own handler for every termination signal right after the child's
initializer (`worker_process_init`) has run, unless the signal is ignored then; so the
initializer only ignores STOP_SIGNAL, and a child's handlers are installed when it starts a
task. An idle child thus sits out STOP_SIGNAL and leaves when its pool closes, cleanly (it used
to take STOP_SIGNAL and then its pool's SIGTERM as two termination signals, and leave with
billiard's exit code 70, which Celery logs at ERROR).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from types import FrameType

from billiard.process import active_children
from celery.signals import task_postrun, task_prerun, worker_process_init, worker_shutting_down

from backfill.jobs.files import file_key, stored_size
from backfill.jobs.models import TERMINAL_STATUSES, Batch, BatchStatus
from backfill.jobs.output import finalize as output
from backfill.jobs.validation import outcome as validation
from backfill.jobs.validation.scan import Limits
from backfill.scheduler.drain.dispatcher import Dispatcher
from backfill.scheduler.fleet.client import FleetClient
from backfill.scheduler.metrics import timed
from backfill.scheduler.runtime import get_admission, make_escalation, make_planner, make_routes
from backfill.scheduler.validation_pool import default_processes, validate_object
from backfill.storage.broker import TaskName, celery_app, send_task
from backfill.storage.db import unit_of_work
from backfill.storage.fleet_models import get_catalog
from backfill.storage.leases import DRAIN_POOL, exclusive_lease, get_lease_store
from backfill.storage.objects import get_object_store
from backfill.storage.settings import get_settings

log = logging.getLogger("backfill.tasks")


VALIDATION_LEASE_TTL_S = 30.0

# Set in a pool child asked to stop while it runs a task; a drain polls it (`Dispatcher`).
SHUTDOWN = threading.Event()
_running = {"tasks": 0}


@task_prerun.connect
def _task_started(**_: object) -> None:
    _running["tasks"] += 1
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(STOP_SIGNAL, _on_stop_signal)


@task_postrun.connect
def _task_ended(**_: object) -> None:
    _running["tasks"] -= 1
    SHUTDOWN.clear()  # the main process takes no new message once it is stopping


# Not SIGTERM: a child signalled by the process group and then by the main process must not
# take the second signal for "asked twice". (Celery leaves SIGUSR2 alone unless CELERY_RDBSIG.)
STOP_SIGNAL = signal.SIGUSR2


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _running["tasks"] and not SHUTDOWN.is_set():
        SHUTDOWN.set()
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # idle, or asked twice: stop now
    os.kill(os.getpid(), signal.SIGTERM)


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    SHUTDOWN.set()


@worker_process_init.connect
def _ignore_stop_signal_while_idle(**_: object) -> None:
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # (billiard leaves an ignored signal alone)


@worker_shutting_down.connect
def _pass_sigterm_to_pool_children(how: str = "", **_: object) -> None:
    """The main process alone got SIGTERM (a container runtime signals PID 1): tell the pool
    children now, so a drain's grace period starts with the main process's."""
    if how != "Warm":
        return
    for child in active_children():
        try:
            if child.pid is not None:
                os.kill(child.pid, STOP_SIGNAL)
        except ProcessLookupError:
            pass


@celery_app.task(name=TaskName.validate_batch.value)
@timed("validation")
def validate_batch(batch_id: str) -> str:
    """Validate a batch's input once. The scheduler loop's re-nudge is the only retry chain:
    a transient failure (fleet, database or store unreachable) returns and waits for it; a
    second message for a batch whose validation is running finds the lease taken and returns;
    any other failure fails the batch with a clear error instead of retrying forever."""
    s = get_settings()
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
                _start_drain(batch_id)
                validation.write_index_parts(unit_of_work, batch_id=batch_id, requests=result.requests)
                if len(result.requests) > validation.FIRST_INDEX_PART:
                    _start_drain(batch_id)  # the rest of its lines, for drains that ran out meanwhile
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


def _start_drain(batch_id: str) -> None:
    try:
        # Every slot held: the drains running release the batch themselves, within a look at the
        # batches (a lingering one looks every few tens of ms); one more would only hold a worker
        # process while it waits for a slot, which finalization may need.
        if get_lease_store().count(DRAIN_POOL) >= get_settings().drains:
            return
        send_task(TaskName.drain)
    except Exception:  # the broker only nudges: the scheduler's tick starts drains too
        log.warning("could not start a drain for batch %s; the scheduler will", batch_id, exc_info=True)


def _start_finalization(batch_id: str) -> None:
    try:
        send_task(TaskName.finalize_batch, batch_id)
    except Exception:
        log.warning("could not start finalizing batch %s; the scheduler will", batch_id, exc_info=True)


@celery_app.task(name=TaskName.finalize_batch.value)
@timed("finalization")
def finalize_batch(batch_id: str) -> str | None:
    return output.finalize_batch(unit_of_work, get_object_store(), batch_id=batch_id)


# Acknowledged when it starts, not when it ends: a drain is only a nudge (the scheduler loop
# starts another while there is work, and its lines are reclaimed if it dies), and a late ack
# after the broker restarted mid-drain hits a dead channel and takes the worker down with it.
@celery_app.task(name=TaskName.drain.value, acks_late=False)
def drain() -> int:
    """Release pending lines onto the fleet for one time slice."""
    s = get_settings()
    leases = get_lease_store()

    async def run() -> int:
        routes = make_routes(s)  # which deployments serve which model: a line goes only to those
        fleet = FleetClient(
            s.fleet_urls,
            timeout_s=s.fleet_timeout_s,
            api_key=s.fleet_api_key,
            redis_url=s.redis_url,
            overflow_urls=s.overflow_urls,
            overflow_api_key=s.overflow_api_key,
            routes=routes,
        )
        try:
            admission = get_admission()
            planner = make_planner()
            dispatcher = Dispatcher(
                store=get_object_store(),
                leases=leases,
                admission=admission,
                # The KV the controller's model leaves to batch work: prefix groups and agent
                # sessions start only while what is in flight fits it (jobs.execution.claims).
                kv_budget_tokens=await asyncio.to_thread(admission.kv_budget_tokens),
                fleet=fleet,
                planner=planner,
                escalation=make_escalation(planner, leases),
                routes=routes,
                pending_models=planner.pending_models,
                max_attempts=s.max_attempts,
                hint_mode=s.fleet_priority_hint,
                shutdown=SHUTDOWN,
                grace_s=s.drain_grace_s,
                db_patience_s=s.db_outage_patience_s,
                on_all_recorded=_start_finalization,
            )
            return await dispatcher.run(s.drain_slice_s, max_drains=s.drains)
        finally:
            await fleet.aclose()

    return asyncio.run(run())
