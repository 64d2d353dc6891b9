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
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import psutil
from celery.signals import worker_shutting_down

log = logging.getLogger(__name__)
EXIT_MARGIN_S = 5.0  # after the drains' grace: their give-back and the pool's own exit
WATCHDOG_EXIT_CODE = 70


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
    watchdog = Watchdog(grace_s + EXIT_MARGIN_S)
    worker_shutting_down.connect(watchdog.arm, weak=False)
    return watchdog
