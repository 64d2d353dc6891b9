"""The scheduler loop: the database is the truth and this loop keeps nudging it forward.

Each tick: expire overdue batches, finish cancellations, reclaim lines whose worker died,
re-nudge validations the broker lost, start finalization, and keep drains running while
there is pending work. Every step is idempotent, so two schedulers are merely wasteful.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import select

from jobs import execution
from jobs.models import Batch, BatchStatus, utcnow
from scheduler.dispatcher import DRAIN_POOL
from scheduler.leases import LeaseStore
from storage.db import unit_of_work

log = logging.getLogger("backfill.scheduler")

RENUDGE_S = 30.0


class Ticker:
    def __init__(
        self,
        *,
        leases: LeaseStore,
        enqueue: Callable[[str, tuple[str, ...]], None],
        drains: int,
    ) -> None:
        self.leases = leases
        self.enqueue = enqueue  # (task name, args)
        self.drains = drains
        self._nudged: dict[tuple[str, str], float] = {}
        self._last_drain_kick = 0.0

    def _nudge(self, task: str, batch_id: str) -> None:
        now = time.monotonic()
        if now - self._nudged.get((task, batch_id), -1e9) >= RENUDGE_S:
            self._nudged[(task, batch_id)] = now
            self.enqueue(task, (batch_id,))

    def tick(self) -> None:
        with unit_of_work() as session:
            execution.expire_overdue(session)
        with unit_of_work() as session:
            to_finalize = execution.batches_to_finalize(session)
        for batch_id in to_finalize:
            self._nudge("backfill.finalize_batch", batch_id)

        with unit_of_work() as session:
            tokens = execution.running_claim_tokens(session)
        alive = self.leases.alive(tokens)
        dead = [t for t in tokens if t not in alive]
        if dead:
            with unit_of_work() as session:
                n = execution.reclaim_orphans(session, dead_tokens=dead)
            log.warning("reclaimed %d lines from %d lapsed workers", n, len(dead))

        stale = utcnow() - timedelta(seconds=10)
        with unit_of_work() as session:
            waiting = list(
                session.execute(
                    select(Batch.id).where(Batch.status == BatchStatus.validating, Batch.created_at < stale)
                ).scalars()
            )
            has_work = bool(execution.pending_batches(session))
        for batch_id in waiting:
            self._nudge("backfill.validate_batch", batch_id)

        if has_work:
            running = self.leases.count(DRAIN_POOL)
            now = time.monotonic()
            if running < self.drains and now - self._last_drain_kick > 2.0:
                self._last_drain_kick = now
                for _ in range(self.drains - running):
                    self.enqueue("backfill.drain", ())

    def run_forever(self, interval_s: float, stop: Callable[[], bool] = lambda: False) -> None:
        while not stop():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:
                log.exception("tick failed")
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
