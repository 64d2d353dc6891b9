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

import logging
import os
import signal
import threading
from types import FrameType

import uvloop
from billiard.process import active_children
from celery.signals import task_postrun, task_prerun, worker_init, worker_process_init, worker_shutting_down
from sqlalchemy.orm import configure_mappers

from backfill.jobs.output import finalize as output
from backfill.scheduler.metrics import timed
from backfill.scheduler.runtime import run_drain
from backfill.scheduler.validation.batch import validate_batch as validate_batch_once
from backfill.storage.broker import TaskName, celery_app, send_task
from backfill.storage.db import unit_of_work
from backfill.storage.leases import DRAIN_POOL, get_lease_store
from backfill.storage.objects import get_object_store
from backfill.storage.settings import get_settings

log = logging.getLogger("backfill.tasks")


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


@worker_init.connect
def _configure_mappers_before_fork(**_: object) -> None:
    """The ORM's mappers configured in the main process, before the pool forks: each child
    would otherwise configure them on its first query (tens of milliseconds of CPU apiece)."""
    configure_mappers()


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
    """Validate a batch's input once (`scheduler.validation.batch.validate_batch`)."""
    return validate_batch_once(batch_id, get_settings(), start_drain=_start_drain)


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
    # On uvloop: a drain's loop turns once or more per fleet call (the call, its reply, the
    # hand-offs to the recorder and the lease returns), and asyncio's own loop and transports
    # in Python were a third of the drain's loop CPU.
    return uvloop.run(run_drain(get_settings(), shutdown=SHUTDOWN, on_all_recorded=_start_finalization))
