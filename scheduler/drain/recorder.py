"""Recording a drain's replies: committed in small groups, held while the database is away.

The recorder owns the buffer between the fleet calls and the database. A transient database
error (unreachable, connection dropped, deadlock) is retried with backoff for up to the
drain's patience; meanwhile `db_ok` is clear, so the drain claims and sends nothing new, and
the buffer (bounded; senders wait when it is full) holds at most what was in flight. Every
write is a compare-and-set on the line's claim, so a group committed whose acknowledgement was
lost is simply refused the second time: nothing is written twice.

A result the database refuses for itself (not a connection problem) is found by splitting the
group; that line spends an attempt instead of blocking the others.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import text
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from backfill.jobs.errors import error_bytes
from backfill.jobs.execution.claims import ClaimedRequest, release_for_retry, requeue_unstarted
from backfill.jobs.execution.replies import Outcome, outcome_of
from backfill.jobs.execution.results import attempts_exceeded, record_group
from backfill.jobs.models import utcnow
from backfill.jobs.sweeps import lines_held_by
from backfill.scheduler.fleet.client import FleetReply
from backfill.storage.db import is_transient, unit_of_work

log = logging.getLogger("backfill.dispatch")

BACKOFF_BASE_S, BACKOFF_CAP_S = 1.0, 60.0
WRITE_GROUP = 200
# How long a group that is not full waits for more replies before it is committed. A commit's
# cost is mostly per group (the statement, the batch's counters, the ledger row, the commit), and
# replies arrive one by one: without the wait a steady stream committed groups of one or two.
# The leases went back as the replies came, so the wait holds up no capacity.
RECORD_LINGER_S = 0.02
RESULT_BUFFER = 4096  # replies waiting to be recorded
DB_RETRY_MAX_S = 2.0  # longest pause between two tries while the database is away


@dataclass(frozen=True)
class Answer:
    """The fleet's reply to a line, parsed once, when it arrives: the drain observes its usage,
    the recorder stores its outcome or, while it is worth retrying, releases the line."""

    outcome: Outcome
    transient: bool  # worth retrying: overload, server error, timeout, connection failure
    sent: bool  # False: the request reached no deployment, so no attempt is spent

    @classmethod
    def of(cls, reply: FleetReply) -> Answer:
        return cls(outcome_of(reply.status_code, reply.body, reply.request_id), reply.transient, reply.sent)


UNRECORDABLE = Answer.of(
    FleetReply(500, error_bytes("result not recordable", type_="server_error"), None, 0.0, transient=True)
)


@dataclass
class Done:
    request: ClaimedRequest
    answer: Answer | None  # None: aborted to give capacity back; requeued, no attempt spent


class Recorder:
    def __init__(
        self,
        *,
        holder: str,
        max_attempts: int,
        patience_s: float,
        finish_by: Callable[[], float | None],
        on_all_recorded: Callable[[str], None] | None = None,
    ) -> None:
        self.holder = holder
        # Told the id of each batch whose last line this recorder wrote, once that is committed:
        # its finalization starts then rather than at the scheduler's next tick.
        self.on_all_recorded = on_all_recorded
        self.max_attempts = max_attempts
        self.patience_s = patience_s
        self.finish_by = finish_by  # a stopping drain's deadline: no retry past it
        self.queue: asyncio.Queue[Done | None] = asyncio.Queue(maxsize=RESULT_BUFFER)
        self.db_ok = asyncio.Event()
        self.db_ok.set()
        self._down_since: float | None = None
        self.given_up: set[tuple[str, int]] = set()  # (batch, line) sent, their replies not recorded
        # (batch, line) answered or aborted, not yet recorded: still running in the database, but
        # done at the fleet, so the drain's claims do not count them against the KV budget.
        self.answered: set[tuple[str, int]] = set()

    async def put(self, done: Done) -> None:
        self.answered.add((done.request.batch_id, done.request.line))
        await self.queue.put(done)

    async def run(self) -> None:
        """Commit results in small groups (one transaction per group, not per line) until None."""
        while True:
            item = await self.queue.get()
            group = [item] if item is not None else []
            stop = self._take_waiting(group) if item is not None else True
            if not stop and len(group) < WRITE_GROUP:
                await asyncio.sleep(RECORD_LINGER_S)
                stop = self._take_waiting(group)
            if group:
                # Sorted, so concurrent drains lock batch rows in one order.
                group.sort(key=lambda d: (d.request.batch_id, d.request.line))
                try:
                    await self._commit_group(group)
                finally:
                    self.answered.difference_update((d.request.batch_id, d.request.line) for d in group)
            if stop:
                return

    def _take_waiting(self, group: list[Done]) -> bool:
        """Move what is queued into `group`, up to WRITE_GROUP; True when the end (None) came."""
        while not self.queue.empty() and len(group) < WRITE_GROUP:
            nxt = self.queue.get_nowait()
            if nxt is None:
                return True
            group.append(nxt)
        return False

    # -- the database's health, as this drain sees it ---------------------------------------

    def unreachable(self, exc: BaseException | None) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("database error (%r): holding replies and sending nothing new until it answers", exc)
        self.db_ok.clear()

    def _back(self) -> None:
        if self._down_since is not None:
            log.info("database answers again after %.1f s", time.monotonic() - self._down_since)
        self._down_since = None
        self.db_ok.set()

    def _out_of_patience(self, state: RetryCallState) -> bool:
        now = time.monotonic()
        finish_by = self.finish_by()
        if finish_by is not None and now >= finish_by:
            return True
        return self._down_since is not None and now - self._down_since >= self.patience_s

    async def wait_for_db(self, until: Callable[[], bool]) -> None:
        """Probe the database with backoff until it answers, or until `until()`."""
        delay = 0.1
        while not self.db_ok.is_set() and not until():
            try:
                await asyncio.to_thread(self._probe)
                self._back()
                return
            except Exception as exc:
                if not is_transient(exc):
                    raise
            try:
                await asyncio.wait_for(self.db_ok.wait(), timeout=delay)
            except TimeoutError:
                delay = min(delay * 2, DB_RETRY_MAX_S)

    @staticmethod
    def _probe() -> None:
        with unit_of_work() as session:
            session.execute(text("SELECT 1"))

    async def give_back_unsent(self, *, in_doubt: bool) -> None:
        """Once everything is recorded, lines the drain still holds were never sent: a claim that
        committed just as the connection dropped looked failed to it. They go back to pending, no
        attempt spent; after such a claim (`in_doubt`) this waits for the database as long as
        replies would. (Lines whose replies were given up were sent: the reconciler takes those
        back, and that try counts.)"""
        give_up_at = time.monotonic() + (self.patience_s if in_doubt else 0.0)
        while True:
            try:
                await asyncio.to_thread(self._requeue_unsent)
                return
            except Exception as exc:
                if not is_transient(exc):
                    raise
                finish_by = self.finish_by()
                if time.monotonic() >= min(give_up_at, give_up_at if finish_by is None else finish_by):
                    log.warning("could not give back unsent lines (%r); the reconciler will", exc)
                    return
                await asyncio.sleep(0.5)

    def _requeue_unsent(self) -> None:
        with unit_of_work() as session:
            for batch_id, lines in lines_held_by(session, self.holder).items():
                unsent = [n for n in lines if (batch_id, n) not in self.given_up]
                if unsent:
                    log.warning(
                        "%s: %d claimed lines of batch %s never sent; requeued", self.holder, len(unsent), batch_id
                    )
                    requeue_unstarted(session, batch_id=batch_id, lines=unsent, claim_token=self.holder)

    # -- committing ----------------------------------------------------------------------------

    async def _commit_group(self, group: list[Done]) -> None:
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(is_transient),
                wait=wait_random_exponential(multiplier=0.05, max=DB_RETRY_MAX_S),
                stop=self._out_of_patience,
                before_sleep=lambda state: self.unreachable(state.outcome.exception() if state.outcome else None),
                reraise=True,
            ):
                with attempt:
                    await asyncio.to_thread(self._commit, group)
            self._back()
        except Exception as exc:
            if is_transient(exc):
                # The lines stay running under this holder; once it is gone they are reclaimed.
                self.given_up.update((d.request.batch_id, d.request.line) for d in group)
                log.error("database away too long: %d replies given up (their lines will be reclaimed)", len(group))
            elif len(group) > 1:
                mid = len(group) // 2
                await self._commit_group(group[:mid])
                await self._commit_group(group[mid:])
            else:
                r = group[0].request
                log.exception("the result of line %s of batch %s cannot be recorded", r.line, r.batch_id)
                try:
                    await asyncio.to_thread(self._commit, [Done(r, UNRECORDABLE)], "its result could not be recorded")
                except Exception:
                    log.exception("could not give back line %s of batch %s; it will be reclaimed", r.line, r.batch_id)

    def _commit(self, group: list[Done], why: str = "") -> None:
        finished: list[tuple[str, int, Outcome]] = []
        with unit_of_work() as session:
            for done in group:
                r, answer = done.request, done.answer
                if answer is None:
                    requeue_unstarted(session, batch_id=r.batch_id, lines=[r.line], claim_token=self.holder)
                    continue
                if answer.transient and (not answer.sent or r.attempts + 1 < self.max_attempts):
                    delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**r.attempts) * random.uniform(0.5, 1.0)
                    release_for_retry(
                        session,
                        batch_id=r.batch_id,
                        line=r.line,
                        claim_token=self.holder,
                        not_before=utcnow() + timedelta(seconds=delay),
                        spend_attempt=answer.sent,  # nothing reached the fleet: no attempt spent
                    )
                    continue
                if why:
                    finished.append((r.batch_id, r.line, attempts_exceeded(r.attempts + 1, why)))
                    continue
                finished.append((r.batch_id, r.line, answer.outcome))
            ready = record_group(session, claim_token=self.holder, results=finished).complete
        for batch_id in ready if self.on_all_recorded else []:
            assert self.on_all_recorded is not None
            self.on_all_recorded(batch_id)
