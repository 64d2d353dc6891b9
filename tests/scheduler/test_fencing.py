"""Two scheduler replicas running the same step at once: a leader that was paused (SIGSTOP, a long
GC pause) and resumes mid-step, while the replica that took over runs the step too. Only the
capacity publications are fenced to the leader's term; every other step of the loop must be
harmless run twice at once. Each test here holds one replica's transaction open in the middle
of the step (as a pause would), runs the other replica's step meanwhile, lets the first one go,
and checks that nothing was done twice: one transition, one attempt spent, one rollup, one
delete, one send. On Postgres (the production database; SQLite has one writer at a time).

The list of steps and why each is harmless is in docs/operations.md ("Two schedulers at once").
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from backfill.jobs import sweeps
from backfill.jobs.billing.ledger import set_price
from backfill.jobs.billing.models import UsageLedgerEntry
from backfill.jobs.execution.claims import claim_requests
from backfill.jobs.execution.replies import Outcome, Usage
from backfill.jobs.execution.results import record_outcomes
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, File, RequestState, new_id, utcnow
from backfill.jobs.output import finalize
from backfill.jobs.retention import purge_file_objects, retire_batch
from backfill.jobs.webhooks.events import EVENT_TYPES, claim_due, create_endpoint, record_attempt, record_batch_event
from backfill.jobs.webhooks.models import WebhookDelivery, WebhookEvent
from backfill.jobs.webhooks.targets import TargetPolicy
from backfill.scheduler.leadership import RedisLeaderLease, lead_while_leader
from backfill.scheduler.webhook_delivery import HOLD_S, WebhookSender
from backfill.storage.objects import LocalObjectStore
from tests.factories import make_batch, make_team

T = TypeVar("T")
REDIS = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/10"
BLOCKED_S = 1.0  # how long the second replica is seen waiting for the first one's row lock


@pytest.fixture
def pg(db: sessionmaker[Session]) -> sessionmaker[Session]:
    if db.kw["bind"].dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: two replicas' steps cannot overlap there")
    return db


@contextmanager
def paused_replica(db: sessionmaker[Session]) -> Iterator[Session]:
    """One replica's transaction, left open mid-step (the replica is paused): committed when the
    block ends (it resumes)."""
    session = db()
    session.begin()
    try:
        yield session
        session.commit()
    finally:
        session.close()


def in_transaction(db: sessionmaker[Session], step: Callable[[Session], T]) -> T:
    with db.begin() as session:
        return step(session)


def waits(future: Future[T]) -> bool:
    """Whether the other replica's step is still waiting (for the paused one's row locks)."""
    try:
        future.result(timeout=BLOCKED_S)
    except TimeoutError:
        return True
    return False


def _running_batch(
    db: sessionmaker[Session], *, lines: int, token: str, attempts: int = 0, expires_in_s: float = 3600
) -> str:
    with db.begin() as s:
        team = make_team(s)
        return make_batch(
            s,
            team,
            lines=lines,
            line_state=RequestState.running,
            claim_token=token,
            attempts=attempts,
            expires_in_s=expires_in_s,
        ).id


# -- expiry ------------------------------------------------------------------------------------


def test_expiry_run_twice_at_once_expires_a_batch_once(pg: sessionmaker[Session]) -> None:
    """The batch row FOR UPDATE, then a compare-and-set on its status: the second expiry waits
    for the first and then finds the batch no longer in progress."""
    batch_id = _running_batch(pg, lines=3, token="drain-1", expires_in_s=-1)
    first, second = utcnow(), utcnow() + timedelta(seconds=30)
    with ThreadPoolExecutor(1) as pool:
        with paused_replica(pg) as resumed:
            assert sweeps.expire_overdue(resumed, now=first) == [batch_id]
            other = pool.submit(in_transaction, pg, lambda s: sweeps.expire_overdue(s, now=second))
            assert waits(other)
        other.result(timeout=30)
    with pg.begin() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None
        assert (batch.status, batch.expired_at) == (BatchStatus.finalizing, first)  # the second changed nothing
        finished = s.execute(
            select(BatchRequest.state, BatchRequest.finished_at).where(BatchRequest.batch_id == batch_id)
        )
        assert set(finished) == {(RequestState.expired, first)}


# -- reclaim -----------------------------------------------------------------------------------


def _lines(db: sessionmaker[Session], batch_id: str) -> list[tuple[str, int, bool]]:
    """Each line's (state, attempts, held by a claim)."""
    with db.begin() as s:
        rows = s.execute(
            select(BatchRequest.state, BatchRequest.attempts, BatchRequest.claim_token)
            .where(BatchRequest.batch_id == batch_id)
            .order_by(BatchRequest.line)
        )
        return [(str(state), int(attempts), token is not None) for state, attempts, token in rows]


def test_reclaim_run_twice_at_once_spends_one_attempt_per_line(pg: sessionmaker[Session]) -> None:
    """Both replicas saw the same drain's heartbeat lapse and reclaim its lines at once. A line
    with attempts left goes back to pending with one attempt spent; a line at the cap fails once
    and its attempts count the try that ran out once. Before, the second reclaim's failed
    compare-and-set was followed by its attempts update anyway (it matched every failed line it
    had read as running): the line ended with an attempt more than it was ever tried."""
    max_attempts = 3
    fresh = _running_batch(pg, lines=2, token="drain-dead")
    worn = _running_batch(pg, lines=1, token="drain-dead", attempts=max_attempts - 1)

    def reclaim(s: Session) -> sweeps.Reclaimed:
        return sweeps.reclaim_orphans(s, dead_tokens=["drain-dead"], max_attempts=max_attempts)

    with ThreadPoolExecutor(1) as pool:
        with paused_replica(pg) as resumed:
            first = reclaim(resumed)
            other = pool.submit(in_transaction, pg, reclaim)
            assert waits(other)
        second = other.result(timeout=30)
    assert (first.requeued[fresh], first.failed[worn]) == (2, 1)
    assert second.total == 0
    assert _lines(pg, fresh) == [(RequestState.pending, 1, False)] * 2
    assert _lines(pg, worn) == [(RequestState.failed, max_attempts, False)]
    with pg.begin() as s:
        batch = s.get(Batch, worn)
        assert batch is not None and (batch.failed, batch.completed) == (1, 0)


# -- retention ---------------------------------------------------------------------------------


def test_retiring_a_batch_twice_at_once_rolls_its_ledger_up_once(pg: sessionmaker[Session]) -> None:
    """The rollup is a compare-and-set on the batch's `ledger_rolled_up_at`, committed with the
    deletion of the per-line rows: the second retirement waits for the first and changes nothing."""
    lines = 6
    with pg.begin() as s:
        set_price(s, model="m", input_micros=150_000, cached_input_micros=75_000, output_micros=600_000)
        team = make_team(s)
        batch_id = make_batch(s, team, lines=lines).id
    with pg.begin() as s:
        claim_requests(s, batch_id=batch_id, limit=lines, claim_token="a")
        answer = Outcome(200, b"{}", "req", Usage(100, 0, 20, 0))
        assert record_outcomes(s, claim_token="a", results=[(batch_id, n, answer) for n in range(1, lines + 1)]) == 6
    with pg.begin() as s:
        s.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(status=BatchStatus.completed, completed_at=utcnow(), output_file_id="out")
        )

    def ledger() -> tuple[int, int]:
        with pg.begin() as s:
            rows, requests = s.execute(
                select(func.count(), func.coalesce(func.sum(UsageLedgerEntry.requests), 0)).where(
                    UsageLedgerEntry.batch_id == batch_id
                )
            ).one()
            return int(rows), int(requests)

    assert ledger() == (lines, lines)
    first_at, second_at = utcnow(), utcnow() + timedelta(seconds=30)
    with ThreadPoolExecutor(1) as pool:
        with paused_replica(pg) as resumed:
            assert retire_batch(resumed, batch_id, now=first_at) == (True, True)
            other = pool.submit(in_transaction, pg, lambda s: retire_batch(s, batch_id, now=second_at))
            assert waits(other)
        assert other.result(timeout=30) == (False, False)
    rows, requests = ledger()
    assert requests == lines  # every request counted once
    with pg.begin() as s:
        per_line = select(func.count()).where(UsageLedgerEntry.batch_id == batch_id, UsageLedgerEntry.line >= 0)
        assert s.execute(per_line).scalar() == 0 and rows >= 1  # rolled up: only the per-minute rows left
    with pg.begin() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and (batch.ledger_rolled_up_at, batch.bodies_purged_at) == (first_at, first_at)
        assert s.execute(select(func.count()).where(BatchRequest.batch_id == batch_id)).scalar() == 0


class CountingStore(LocalObjectStore):
    """A local object store that counts its deletes, by key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.deleted: list[str] = []

    def delete(self, key: str) -> None:
        self.deleted.append(key)
        super().delete(key)


def test_purging_a_file_twice_at_once_removes_its_object_once(pg: sessionmaker[Session], tmp_path: Path) -> None:
    """Each file is purged in a transaction of its own that reads it again FOR UPDATE SKIP LOCKED:
    a file another replica is purging right now is left to it. Before, both replicas read it
    unpurged, both deleted its object and both stamped it purged (the later stamp winning)."""
    store = CountingStore(tmp_path / "objects")
    now = utcnow()
    with pg.begin() as s:
        team = make_team(s)
        file_id = new_id()
        key = f"files/{team.id}/{file_id}"
        store.put(key, [b'{"x": 1}\n'])
        s.add(File(id=file_id, team_id=team.id, purpose="batch", filename="in.jsonl", bytes=9, object_key=key))
        s.flush()
        s.execute(update(File).where(File.id == file_id).values(deleted_at=now))

    paused, resume = threading.Event(), threading.Event()

    @contextmanager
    def pausing_units() -> Iterator[Session]:
        """The paused replica's units of work: the one that purges a file stops before it commits."""
        with pg.begin() as session:
            yield session
            if session.new or session.dirty:  # (the listing transaction writes nothing)
                paused.set()
                assert resume.wait(30)

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(purge_file_objects, pausing_units, store, now=now, limit=10)
        assert paused.wait(30)
        try:
            second = purge_file_objects(pg.begin, store, now=now + timedelta(seconds=30), limit=10)
        finally:
            resume.set()
        assert first.result(timeout=30) == 1
    assert second == 0
    assert store.deleted == [key]
    with pg.begin() as s:
        row = s.get(File, file_id)
        assert row is not None and row.purged_at == now


# -- what the loop enqueues: a finalization sent twice ----------------------------------------


def test_a_batch_finalized_twice_at_once_gets_its_files_and_its_event_once(
    pg: sessionmaker[Session], tmp_path: Path
) -> None:
    """Both replicas nudged the same batch's finalization and two workers run it at once: both
    write the same bytes at the same keys, and only the winner of the compare-and-set to the
    terminal status writes the File rows and the webhook event."""
    store = LocalObjectStore(tmp_path / "objects")
    batch_id = _running_batch(pg, lines=2, token="a")
    with pg.begin() as s:
        team_id = s.execute(select(Batch.team_id).where(Batch.id == batch_id)).scalar_one()
        _endpoint(s, team_id)  # (a team with no endpoint gets no event at all)
    answer = Outcome(200, b'{"ok":true}', "req", Usage(3, 0, 2, 0))
    with pg.begin() as s:
        assert record_outcomes(s, claim_token="a", results=[(batch_id, 1, answer), (batch_id, 2, answer)]) == 2
    plans = []
    for _ in range(2):
        with pg.begin() as s:
            plan = finalize.begin(s, batch_id)
        assert isinstance(plan, finalize.Plan)
        plans.append((plan, finalize._write_files(pg.begin, store, plan)))
    written = plans[0][1].sizes
    with ThreadPoolExecutor(1) as pool:
        with paused_replica(pg) as resumed:
            assert finalize.complete(resumed, *plans[0]) == BatchStatus.completed
            other = pool.submit(in_transaction, pg, lambda s: finalize.complete(s, *plans[1]))
            assert waits(other)
        assert other.result(timeout=30) == BatchStatus.completed  # the other's status: it lost
    with pg.begin() as s:
        assert s.execute(select(func.count()).where(WebhookEvent.batch_id == batch_id)).scalar() == 1
        files = s.execute(select(File.id).where(File.filename.like(f"batch_{batch_id}_%"))).scalars().all()
        assert len(files) == len(written) >= 1


# -- webhook rounds ----------------------------------------------------------------------------


def _endpoint(s: Session, team_id: str) -> None:
    create_endpoint(
        s,
        team_id=team_id,
        name="r",
        url="http://127.0.0.1:9/hook",
        event_types=list(EVENT_TYPES),
        policy=TargetPolicy.of(["127.0.0.1/32"], allow_loopback=True),
    )


def _due_deliveries(db: sessionmaker[Session], n: int) -> None:
    with db.begin() as s:
        team = make_team(s)
        _endpoint(s, team.id)
        for _ in range(n):
            batch = make_batch(s, team, lines=1, status=BatchStatus.completed)
            assert record_batch_event(s, batch_id=batch.id, status=BatchStatus.completed) is not None


def test_two_webhook_rounds_at_once_claim_disjoint_deliveries_and_record_each_attempt_once(
    pg: sessionmaker[Session],
) -> None:
    """Claims skip the rows another round holds locked and move each claimed delivery's next
    attempt a hold ahead: two rounds at once never take the same delivery. An attempt recorded
    twice (a sender that outlived its hold) is a compare-and-set on the attempt count: once."""
    _due_deliveries(pg, 4)
    with ThreadPoolExecutor(1) as pool:
        with paused_replica(pg) as resumed:
            mine = claim_due(resumed, limit=3)
            other = pool.submit(in_transaction, pg, lambda s: claim_due(s, limit=10))
            theirs = other.result(timeout=30)  # skips the locked rows: no wait
        assert len(mine) == 3 and len(theirs) == 1
        assert not {d.delivery_id for d in mine} & {d.delivery_id for d in theirs}
    with pg.begin() as s:
        assert claim_due(s, limit=10) == []  # every one held now
    due = mine[0]
    with pg.begin() as s:
        assert record_attempt(s, due=due, status_code=200, error=None) == "delivered"
    with pg.begin() as s:
        assert record_attempt(s, due=due, status_code=500, error=None) is None
        row = s.get(WebhookDelivery, due.delivery_id)
        assert row is not None and (row.attempts, row.status, len(row.history)) == (1, "delivered", 1)


def test_a_sender_resumed_after_its_claims_hold_sends_nothing(pg: sessionmaker[Session]) -> None:
    """A round claimed a delivery, then its replica froze past the hold: the delivery may be
    claimed and sent by the new leader's round meanwhile, so the resumed sender does not send it
    (no attempt recorded, due again). A fresh claim is sent (here refused: a loopback target)."""
    _due_deliveries(pg, 2)
    with pg.begin() as s:
        stale, fresh = claim_due(s, limit=2)
    sender = WebhookSender(units=pg.begin)
    sender.deliver(stale, claimed_at=time.monotonic() - HOLD_S)
    sender.deliver(fresh, claimed_at=time.monotonic())
    with pg.begin() as s:
        attempts = {d.id: d.attempts for d in s.execute(select(WebhookDelivery)).scalars()}
    assert attempts == {stale.delivery_id: 0, fresh.delivery_id: 1}
    with pg.begin() as s:  # once its hold has passed, the next round takes it
        later = claim_due(s, now=utcnow() + timedelta(seconds=HOLD_S + 1))
    assert stale.delivery_id in {d.delivery_id for d in later}


# -- the leader itself -------------------------------------------------------------------------


def test_a_leader_whose_own_clock_says_it_lost_the_lease_says_it_stands_by(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A leader resumed after a pause may ask `deposed()` before its keeper wakes to renew: its
    own clock ends its term. It stands by and says so, as when a renewal is refused (the fault
    suite's paused leader looks for that line). Here the keeper never renews, so only the clock
    can tell: the loop asks until it is told, then returns."""
    lease = RedisLeaderLease(REDIS, ttl_s=2.0, namespace=f"fence-{uuid.uuid4().hex[:8]}")
    told = threading.Event()
    stopping = threading.Event()  # (the process's own stop, as SIGTERM sets it)

    def lead(deposed: Callable[[], bool]) -> None:
        while not deposed():
            time.sleep(0.05)
        told.set()

    def messages() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "backfill.leader"]

    replica = threading.Thread(
        target=lead_while_leader,
        args=(lease, lead),
        kwargs={"stop": stopping.is_set, "renew_every_s": 3600, "progress_timeout_s": 3600},
    )
    with caplog.at_level(logging.INFO, logger="backfill.leader"):
        replica.start()
        try:
            assert told.wait(30)
            deadline = time.monotonic() + 10
            while len(messages()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stopping.set()
            replica.join(30)
    first, then = messages()[:2]
    assert first.startswith("this scheduler leads now") and then == "lost the leader lease: standing by"
