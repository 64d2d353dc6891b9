"""The scheduler loop: the database is the truth and this loop keeps nudging it forward.

Each tick: expire overdue batches, finish cancellations, reconcile (reclaim lines whose
worker died, resume batches that stopped making progress), re-nudge validations the broker
lost, start finalization, and keep drains running while there is pending work; every
`retention_interval_s`, apply retention. Every step is idempotent and harmless run by two
schedulers at once (why, step by step: docs/operations.md, "Two schedulers at once"; shown by
tests/scheduler/test_fencing.py); still, a leader asks whether it still leads before each step
(`Ticker.fence`), so one that was paused or stuck and lost its lease meanwhile stops at the next
step, and each ask tells the lease keeper the loop is making progress (`scheduler.leadership`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

from sqlalchemy import select

from backfill.jobs import retention, sweeps
from backfill.jobs.models import Batch, BatchStatus, utcnow
from backfill.jobs.sweeps import PendingBatch
from backfill.scheduler import webhook_delivery
from backfill.storage.broker import TaskName
from backfill.storage.db import unit_of_work
from backfill.storage.leases import DRAIN_POOL, LeaseStore
from backfill.storage.objects import get_object_store
from backfill.storage.settings import get_settings

log = logging.getLogger("backfill.scheduler")

RENUDGE_S = 30.0
# How long a tick looks again at batches it just expired, and how often (`_finalize_as_they_settle`).
SETTLE_WAIT_S = 1.0
SETTLE_POLL_S = 0.05


class Deposed(Exception):
    """This replica no longer leads: the tick stops before its next step."""


class Enqueue(Protocol):
    """Sends a task by name with id arguments: `storage.broker.send_task` in a process."""

    def __call__(self, name: TaskName, /, *args: str) -> None: ...


class Reconciler:
    """Finds orphaned work and resumes it, saying what it did.

    - Lines running under a holder whose heartbeat is gone are reclaimed (an attempt spent; past
      the cap the line fails with `max_attempts_exceeded`), but only once the heartbeat has been
      missing for a whole TTL, seen by two ticks: a Redis that restarted empty loses every
      heartbeat at once, and live drains re-assert theirs within a third of a TTL.
    - A batch with work left whose counters have not moved for `stall_after_s` is looked at:
      lines under a live drain are left alone (slow, or waiting for the database), lines ready to
      run with no live drain on the batch get a drain started now, and a batch with nothing left
      to run gets its finalization nudged now.
    """

    def __init__(self, *, leases: LeaseStore, max_attempts: int, heartbeat_ttl_s: float, stall_after_s: float) -> None:
        self.leases = leases
        self.max_attempts = max_attempts
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.stall_after_s = stall_after_s
        self._missing: dict[str, tuple[float, int]] = {}  # holder -> (first seen missing, ticks seen)
        self._progress: dict[str, tuple[int, float]] = {}  # batch -> (lines left, since)

    def reclaim(self) -> sweeps.Reclaimed:
        with unit_of_work() as session:
            tokens = sweeps.running_claim_tokens(session)
        alive = self.leases.alive(tokens)
        now = time.monotonic()
        seen = {t: self._missing.get(t, (now, 0)) for t in tokens if t not in alive}
        self._missing = {t: (since, n + 1) for t, (since, n) in seen.items()}
        lapsed = [t for t, (since, n) in self._missing.items() if n >= 2 and now - since >= self.heartbeat_ttl_s]
        if not lapsed:
            return sweeps.Reclaimed()
        with unit_of_work() as session:
            out = sweeps.reclaim_orphans(session, dead_tokens=lapsed, max_attempts=self.max_attempts)
        for t in lapsed:
            self._missing.pop(t, None)
        for batch_id in sorted(set(out.requeued) | set(out.failed)):
            log.warning(
                "reconciler: batch %s: took %d lines back from lapsed drains (an attempt each), %d of them past "
                "the attempt cap went to the error file",
                batch_id,
                out.requeued[batch_id] + out.failed[batch_id],
                out.failed[batch_id],
            )
        return out

    def resume_stalled(self, pending: list[PendingBatch]) -> list[tuple[TaskName, str]]:
        """What to send for batches that stopped making progress: (task, batch id or "")."""
        now = time.monotonic()
        actions: list[tuple[TaskName, str]] = []
        progress: dict[str, tuple[int, float]] = {}
        for b in pending:
            left, since = self._progress.get(b.batch_id, (b.remaining, now))
            if left != b.remaining or now - since < self.stall_after_s:
                progress[b.batch_id] = (b.remaining, since if left == b.remaining else now)
                continue
            progress[b.batch_id] = (b.remaining, now)  # looked at again after another stall period
            actions += self._resume(b.batch_id, idle_s=now - since)
        self._progress = progress
        return actions

    def _resume(self, batch_id: str, *, idle_s: float) -> list[tuple[TaskName, str]]:
        with unit_of_work() as session:
            census = sweeps.line_census(session, batch_id)
        live = self.leases.alive(sorted(census.holders)) if census.holders else set()
        what = f"reconciler: batch {batch_id}: no progress for {idle_s:.0f} s"
        if live:
            log.info("%s; %d lines running under %d live drains: left to them", what, census.running, len(live))
            return []
        if census.running:
            log.warning(
                "%s; %d lines held by lapsed drains: reclaimed once their heartbeat has been gone a TTL",
                what,
                census.running,
            )
        if census.ready:
            log.warning(
                "%s; %d lines ready and no live drain on them (%d drain slots held): started a drain",
                what,
                census.ready,
                self.leases.count(DRAIN_POOL),
            )
            return [(TaskName.drain, "")]
        if census.backing_off:
            log.info("%s; %d lines waiting out a retry backoff", what, census.backing_off)
            return []
        if not census.running:
            log.warning("%s; nothing left to run: finalization nudged", what)
            return [(TaskName.finalize_batch, batch_id)]
        return []


class Ticker:
    def __init__(
        self,
        *,
        leases: LeaseStore,
        enqueue: Enqueue,
        drains: int,
        retention_policy: retention.RetentionPolicy | None = None,
        retention_interval_s: float = 60.0,
        reconciler: Reconciler | None = None,
    ) -> None:
        self.leases = leases
        self.enqueue = enqueue
        self.drains = drains
        s = get_settings()
        self.reconciler = reconciler or Reconciler(
            leases=leases,
            max_attempts=s.max_attempts,
            heartbeat_ttl_s=s.lease_ttl_s,
            stall_after_s=s.stall_after_s,
        )
        self.retention_policy = retention_policy
        self.retention_interval_s = retention_interval_s
        self._last_retention = -1e9
        self._retirement_backlog = False  # the last retention pass left batches to retire
        self._nudged: dict[tuple[TaskName, str], float] = {}
        self._last_drain_kick = 0.0
        self._deposed: Callable[[], bool] = lambda: False

    def fence(self, step: str) -> None:
        """Before a step with side effects: stop the tick if this replica no longer leads."""
        if self._deposed():
            raise Deposed(step)

    def _nudge(self, task: TaskName, batch_id: str) -> None:
        now = time.monotonic()
        if now - self._nudged.get((task, batch_id), -1e9) >= RENUDGE_S:
            self._nudged[(task, batch_id)] = now
            self.enqueue(task, batch_id)

    def _forget_nudges(self, wanted: set[tuple[TaskName, str]]) -> None:
        """Keep only the nudges still spacing out a nudge this tick might send: a batch no longer
        in a state that needs nudging (finished, say) is forgotten, and so is any nudge older
        than RENUDGE_S (it no longer holds the next one back). Else one entry per batch, forever."""
        now = time.monotonic()
        self._nudged = {k: at for k, at in self._nudged.items() if k in wanted and now - at < RENUDGE_S}

    def tick(self) -> None:
        self.fence("expiry")
        with unit_of_work() as session:
            expired = sweeps.expire_overdue(session)
        with unit_of_work() as session:
            to_finalize = sweeps.batches_to_finalize(session)
        wanted = {(TaskName.finalize_batch, b) for b in (*to_finalize, *expired)}
        self.fence("finalization")
        for batch_id in to_finalize:
            self._nudge(TaskName.finalize_batch, batch_id)
        self._finalize_as_they_settle([b for b in expired if b not in to_finalize])

        self.fence("reclaim")
        try:
            self.reconciler.reclaim()
        except Exception:  # (Redis away: nothing is reclaimed until its heartbeats can be read)
            log.warning("reclaim skipped", exc_info=True)

        stale = utcnow() - timedelta(seconds=10)
        with unit_of_work() as session:
            waiting = list(
                session.execute(
                    select(Batch.id).where(Batch.status == BatchStatus.validating, Batch.created_at < stale)
                ).scalars()
            )
            # (A validation writing an index holds its lease: a nudge then returns at once.)
            waiting += sweeps.indexing_batches(session, started_before=stale)
            pending = sweeps.pending_batches(session)
            has_work = bool(pending)
        wanted |= {(TaskName.validate_batch, b) for b in waiting}
        # (The stall check's own nudges drop their entry before they nudge: nothing to keep.)
        self._forget_nudges(wanted)
        self.fence("validation nudges")
        for batch_id in waiting:
            self._nudge(TaskName.validate_batch, batch_id)
        try:
            for task, batch_id in self.reconciler.resume_stalled(pending):
                self._nudged.pop((task, batch_id), None)
                if batch_id:
                    self._nudge(task, batch_id)
                else:
                    self.enqueue(task)
        except Exception:
            log.warning("stall check skipped", exc_info=True)

        if has_work:
            self.fence("drains")
            running = self.leases.count(DRAIN_POOL)
            now = time.monotonic()
            if running < self.drains and now - self._last_drain_kick > 2.0:
                self._last_drain_kick = now
                for _ in range(self.drains - running):
                    self.enqueue(TaskName.drain)

        self.fence("webhooks")
        webhook_delivery.deliver_in_background()  # due webhooks, in a thread of their own
        self.fence("retention")
        self.retain()

    def _finalize_as_they_settle(self, batch_ids: list[str]) -> None:
        """Batches that just expired with a line a drain was recording (the expiry skips it):
        the drain commits it within moments, so look again for a short while and nudge each
        batch's finalization once it settles, rather than a tick later."""
        deadline = time.monotonic() + SETTLE_WAIT_S
        while batch_ids and time.monotonic() < deadline:
            time.sleep(SETTLE_POLL_S)
            self.fence("finalization")
            with unit_of_work() as session:
                settled = sweeps.settled(session, batch_ids, status=BatchStatus.finalizing)
            for batch_id in settled:
                self._nudge(TaskName.finalize_batch, batch_id)
            batch_ids = [b for b in batch_ids if b not in settled]

    def retain(self, *, force: bool = False) -> retention.RetentionReport | None:
        """Apply retention when it is due (or now, with force), in short transactions. While the
        last pass retired as many batches as a pass may (a backlog: the first pass after an
        upgrade finds every batch ever finished), each tick retires the next few batches, and
        only those: the loop keeps ticking between them."""
        now = time.monotonic()
        policy = self.retention_policy
        if policy is None:
            return None
        if force or now - self._last_retention >= self.retention_interval_s:
            self._last_retention = now
            report = retention.run_retention(unit_of_work, get_object_store(), policy=policy)
        elif self._retirement_backlog:
            report = retention.retire_ended_batches(
                unit_of_work, now=utcnow(), grace_s=policy.result_body_grace_s, limit=policy.batches_per_pass
            )
        else:
            return None
        self._retirement_backlog = report.retired >= policy.batches_per_pass
        if report:
            log.info(
                "retention: removed %d file objects and %d orphaned objects, retired %d batches "
                "(line rows of %d removed, %d ledgers rolled up)",
                report.file_objects,
                report.orphans,
                report.retired,
                report.body_batches,
                report.ledgers,
            )
        return report

    def run_forever(self, interval_s: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Tick until `stop()`; `stop` is also the fence each step asks (`fence`)."""
        self._deposed = stop
        while not stop():
            started = time.monotonic()
            try:
                self.tick()
            except Deposed as d:
                log.warning("not the leader any more: this tick stopped before its %s", d)
                return
            except Exception:
                log.exception("tick failed")
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
