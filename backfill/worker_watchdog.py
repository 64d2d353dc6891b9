"""`backfill worker` ends within its grace period once told to stop, whatever its pool does.

Celery answers SIGTERM with a warm shutdown that waits for the pool; a pool child that died or
hangs, or a second signal arriving mid-shutdown, could leave the main process waiting forever,
and a normal interpreter exit runs billiard's pool finalizer (Pool._help_stuff_finish ->
_terminate_pool from multiprocessing.util._exit_function), which deadlocks when the pool's
children are gone. So: from the first shutdown signal a watchdog thread gives the worker its
drains' grace (BACKFILL_DRAIN_GRACE_S) plus a margin to give lines back, then kills what is
left of its pool and leaves with os._exit; and when Celery returns, the process leaves with
os._exit as well, skipping the finalizers (nothing of backfill's needs them: every line a drain
held is given back or recorded in the database before the drain returns).

A worker with no task running leaves at once (`IdleExit`): Celery's warm shutdown of an idle
prefork pool took about 4 s on a loaded 2-core machine (its consumer loop notices the stop only
after its next 2 s wait for messages, then it joins the pool's threads and children and its
timer), all of it waiting on nothing. The same holds once the last running task has ended: a
drain told to stop has given its lines back by then. A message the consumer took from the broker
in the instant before the exit is lost to this worker; every task is a nudge that the scheduler
repeats (validation, drains, finalization), and each is idempotent.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)
EXIT_MARGIN_S = 5.0  # after the drains' grace: their give-back and the pool's own exit
WATCHDOG_EXIT_CODE = 70
IDLE_POLL_S = 0.05
IDLE_SETTLE_S = 0.2  # idle this long before leaving: a task's ack follows the end of its request


def kill_children() -> None:
    """SIGKILL every descendant of this process (the pool and anything it started)."""
    for child in psutil.Process().children(recursive=True):
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def leave(code: int) -> None:
    """Exit now, without interpreter finalizers (see the module's docstring)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def no_task_running() -> bool:
    """No request reserved by this worker (received, waiting for a pool process) nor running."""
    from celery.worker import state

    return not state.reserved_requests and not state.active_requests


class IdleExit:
    """Once told to stop, leave as soon as no task runs (at once when idle), without Celery's
    warm shutdown of the pool (see the module's docstring)."""

    def __init__(self, idle: Callable[[], bool] = no_task_running, settle_s: float = IDLE_SETTLE_S) -> None:
        self.idle = idle
        self.settle_s = settle_s
        self._armed = threading.Event()

    def arm(self, **_: object) -> None:
        if self._armed.is_set():
            return
        self._armed.set()
        threading.Thread(target=self._watch, name="stop-when-idle", daemon=True).start()

    def _watch(self) -> None:
        idle_since: float | None = None
        while True:
            now = time.monotonic()
            idle_since = (idle_since or now) if self.idle() else None
            if idle_since is not None and now - idle_since >= self.settle_s:
                break
            time.sleep(IDLE_POLL_S)
        log.info("worker stopping with no task running: leaving now, without waiting for its idle pool")
        # The pool's supervisor thread would report its children's deaths at ERROR on the way out:
        # nothing is logged from here on (the process is gone within microseconds).
        logging.disable(logging.CRITICAL)
        kill_children()
        leave(0)


class Watchdog:
    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._armed = threading.Event()

    def arm(self, **_: object) -> None:
        """Connected to Celery's worker_shutting_down (the main process, at the first signal)."""
        if self._armed.is_set():
            return
        self._armed.set()
        threading.Thread(target=self._expire, name="stop-watchdog", daemon=True).start()

    def _expire(self) -> None:
        time.sleep(self.deadline_s)
        log.error("worker still stopping %.0f s after it was told to: killing its pool and exiting", self.deadline_s)
        kill_children()
        leave(WATCHDOG_EXIT_CODE)


def install(grace_s: float) -> Watchdog:
    # Imported here, not with the module: `backfill up` leaves through `leave` and never loads Celery.
    from celery.signals import worker_shutting_down

    watchdog = Watchdog(grace_s + EXIT_MARGIN_S)
    worker_shutting_down.connect(watchdog.arm, weak=False)
    worker_shutting_down.connect(IdleExit().arm, weak=False)
    return watchdog
