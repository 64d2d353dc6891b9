"""The scheduler loop: the database is the truth and this loop keeps nudging it forward.

Each tick: expire overdue batches, finish cancellations, reclaim lines whose worker died,
re-nudge validations the broker lost, start finalization, and keep drains running while
there is pending work; every `retention_interval_s`, apply retention. Every step is
idempotent, so two schedulers are merely wasteful.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

from sqlalchemy import select

from jobs import retention, sweeps
from jobs.models import Batch, BatchStatus, utcnow
from scheduler.dispatcher import DRAIN_POOL
from scheduler.leases import LeaseStore
from storage.broker import TaskName
from storage.db import unit_of_work
from storage.objects import get_object_store

log = logging.getLogger("backfill.scheduler")

RENUDGE_S = 30.0


class Enqueue(Protocol):
    """Sends a task by name with id arguments: `storage.broker.send_task` in a process."""

    def __call__(self, name: TaskName, /, *args: str) -> None: ...


class Ticker:
    def __init__(
        self,
        *,
        leases: LeaseStore,
        enqueue: Enqueue,
        drains: int,
        retention_policy: retention.RetentionPolicy | None = None,
        retention_interval_s: float = 60.0,
    ) -> None:
        self.leases = leases
        self.enqueue = enqueue
        self.drains = drains
        self.retention_policy = retention_policy
        self.retention_interval_s = retention_interval_s
        self._last_retention = -1e9
        self._nudged: dict[tuple[TaskName, str], float] = {}
        self._last_drain_kick = 0.0

    def _nudge(self, task: TaskName, batch_id: str) -> None:
        now = time.monotonic()
        if now - self._nudged.get((task, batch_id), -1e9) >= RENUDGE_S:
            self._nudged[(task, batch_id)] = now
            self.enqueue(task, batch_id)

    def tick(self) -> None:
        with unit_of_work() as session:
            sweeps.expire_overdue(session)
        with unit_of_work() as session:
            to_finalize = sweeps.batches_to_finalize(session)
        for batch_id in to_finalize:
            self._nudge(TaskName.finalize_batch, batch_id)

        with unit_of_work() as session:
            tokens = sweeps.running_claim_tokens(session)
        alive = self.leases.alive(tokens)
        dead = [t for t in tokens if t not in alive]
        if dead:
            with unit_of_work() as session:
                n = sweeps.reclaim_orphans(session, dead_tokens=dead)
            log.warning("reclaimed %d lines from %d lapsed workers", n, len(dead))

        stale = utcnow() - timedelta(seconds=10)
        with unit_of_work() as session:
            waiting = list(
                session.execute(
                    select(Batch.id).where(Batch.status == BatchStatus.validating, Batch.created_at < stale)
                ).scalars()
            )
            has_work = bool(sweeps.pending_batches(session))
        for batch_id in waiting:
            self._nudge(TaskName.validate_batch, batch_id)

        if has_work:
            running = self.leases.count(DRAIN_POOL)
            now = time.monotonic()
            if running < self.drains and now - self._last_drain_kick > 2.0:
                self._last_drain_kick = now
                for _ in range(self.drains - running):
                    self.enqueue(TaskName.drain)

        self.retain()

    def retain(self, *, force: bool = False) -> retention.RetentionReport | None:
        """Apply retention when it is due (or now, with force)."""
        now = time.monotonic()
        if self.retention_policy is None or (not force and now - self._last_retention < self.retention_interval_s):
            return None
        self._last_retention = now
        with unit_of_work() as session:
            report = retention.run_retention(session, get_object_store(), policy=self.retention_policy)
        if report:
            log.info(
                "retention: removed %d file objects and %d orphaned objects, purged the bodies of %d batches",
                report.file_objects,
                report.orphans,
                report.body_batches,
            )
        return report

    def run_forever(self, interval_s: float, stop: Callable[[], bool] = lambda: False) -> None:
        while not stop():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:
                log.exception("tick failed")
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
