"""A worker told to stop leaves as soon as no task runs (`backfill.worker_watchdog.IdleExit`),
without fakes of processes: the exit itself is recorded instead of taken."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from backfill import worker_watchdog


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.children_killed = 0
        self.done = threading.Event()

    def leave(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()

    def kill_children(self) -> None:
        self.children_killed += 1


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> Iterator[Exits]:
    recorded = Exits()
    monkeypatch.setattr(worker_watchdog, "leave", recorded.leave)
    monkeypatch.setattr(worker_watchdog, "kill_children", recorded.kill_children)
    yield recorded
    logging.disable(logging.NOTSET)  # (the exit silences logging for the rest of the process)


def test_an_idle_worker_leaves_at_once(exits: Exits) -> None:
    idle_exit = worker_watchdog.IdleExit(idle=lambda: True, settle_s=0.0)
    idle_exit.arm(sig="SIGTERM", how="Warm")
    assert exits.done.wait(10)
    assert (exits.codes, exits.children_killed) == ([0], 1)


def test_a_busy_worker_leaves_only_once_its_task_has_ended(exits: Exits) -> None:
    running = threading.Event()
    running.set()
    idle_exit = worker_watchdog.IdleExit(idle=lambda: not running.is_set(), settle_s=0.1)
    idle_exit.arm()
    idle_exit.arm()  # a second signal: still one watcher
    assert not exits.done.wait(0.5)
    running.clear()
    assert exits.done.wait(10)
    assert (exits.codes, exits.children_killed) == ([0], 1)


def test_a_task_starting_within_the_settle_time_keeps_the_worker(exits: Exits) -> None:
    """Idle for a moment only (a task's request ends just before its ack, or a message arrives):
    the worker leaves only after `settle_s` of idleness in a row."""
    answers = iter([True, False, False])

    def idle() -> bool:
        return next(answers, True)

    started = time.monotonic()
    idle_exit = worker_watchdog.IdleExit(idle=idle, settle_s=0.3)
    idle_exit.arm()
    assert exits.done.wait(10)
    # (no upper bound: the machine may be slow) it waited out a settle after the busy polls
    assert time.monotonic() - started >= 0.3 + 2 * worker_watchdog.IDLE_POLL_S


def test_no_task_running_reads_celery_s_worker_state() -> None:
    from celery.worker import state

    assert worker_watchdog.no_task_running()

    class Request:  # (the sets hold requests weakly)
        pass

    request = Request()
    state.active_requests.add(request)
    try:
        assert not worker_watchdog.no_task_running()
    finally:
        state.active_requests.discard(request)
