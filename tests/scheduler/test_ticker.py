"""The scheduler loop's nudges: which task, by its `TaskName`, for which batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from backfill.jobs import sweeps
from backfill.jobs.models import Batch, BatchRequest, BatchStatus, utcnow
from backfill.scheduler.ticker import Ticker
from backfill.storage.broker import TaskName
from backfill.storage.db import unit_of_work
from backfill.storage.leases import SqlLeaseStore
from tests.factories import make_batch, make_team
from tests.process_env import scratch_database


@pytest.fixture(scope="module")
def scratch_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A database of its own, used in-process through the usual settings (the ticker opens its
    own units of work)."""
    with scratch_database("backfill_ticker", tmp_path_factory.mktemp("ticker-home")) as url:
        yield url


def _batch(team_id: str, status: BatchStatus, *, age_s: float = 0.0, expires_in_s: float = 3600, lines: int = 0) -> str:
    with unit_of_work() as s:
        return make_batch(s, team_id, lines=lines, status=status, age_s=age_s, expires_in_s=expires_in_s).id


def test_a_tick_enqueues_each_task_by_its_name(scratch_db: str) -> None:
    with unit_of_work() as s:
        team = make_team(s, "ticker")
        team_id = team.id
    finalizing = _batch(team_id, BatchStatus.finalizing)
    overdue = _batch(team_id, BatchStatus.in_progress, expires_in_s=-1, lines=1)
    lost_validation = _batch(team_id, BatchStatus.validating, age_s=60)
    _batch(team_id, BatchStatus.validating)  # just created: its own message is still on the way
    _batch(team_id, BatchStatus.in_progress, lines=2)  # work left: drains are kept running
    _batch(team_id, BatchStatus.completed)

    sent: list[tuple[TaskName, tuple[str, ...]]] = []

    def enqueue(name: TaskName, /, *args: str) -> None:
        sent.append((name, args))

    ticker = Ticker(leases=SqlLeaseStore(), enqueue=enqueue, drains=2)
    ticker.tick()
    assert all(type(name) is TaskName for name, _ in sent)
    assert sorted(sent) == sorted(
        [
            (TaskName.finalize_batch, (finalizing,)),
            (TaskName.finalize_batch, (overdue,)),  # expired in this same tick
            (TaskName.validate_batch, (lost_validation,)),
            (TaskName.drain, ()),
            (TaskName.drain, ()),
        ]
    )
    # A second tick right away repeats nothing: nudges are spaced out.
    sent.clear()
    ticker.tick()
    assert sent == []


def test_an_expired_batch_is_finalized_on_the_tick_after_its_last_running_line_is_recorded(scratch_db: str) -> None:
    """A batch that expires while a drain is recording one of its lines keeps that line running
    (`expire_overdue` skips it); finalization must come once it is recorded, not a re-nudge
    interval (30 s) later, which a nudge spent while the line still ran used to cost."""
    from backfill.jobs.models import RequestState

    with unit_of_work() as s:
        team = make_team(s, "ticker-expiry")
        team_id = team.id
    batch_id = _batch(team_id, BatchStatus.finalizing, lines=2)
    with unit_of_work() as s:
        s.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.line == 1)
            .values(state=RequestState.running, claim_token="drain-1", claimed_at=utcnow())
        )

    sent: list[tuple[TaskName, tuple[str, ...]]] = []
    ticker = Ticker(leases=SqlLeaseStore(), enqueue=lambda name, *args: sent.append((name, args)), drains=0)
    ticker.tick()
    assert (TaskName.finalize_batch, (batch_id,)) not in sent  # a line still runs: nothing to do yet

    with unit_of_work() as s:  # the drain records its answer
        s.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id, BatchRequest.line == 1)
            .values(state=RequestState.succeeded, claim_token=None, finished_at=utcnow())
        )
    ticker.tick()
    assert (TaskName.finalize_batch, (batch_id,)) in sent


def test_a_batch_that_expires_while_a_line_is_recorded_is_finalized_in_the_same_tick(
    scratch_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The expiry skips a line a drain holds locked while it records it; the drain commits
    moments later, and the tick that expired the batch nudges its finalization then, not a tick
    (a second) later: for a small batch that second was most of its finalization."""
    import threading
    import time

    from sqlalchemy import select

    from backfill.jobs.models import RequestState
    from backfill.storage.db import get_engine

    with unit_of_work() as s:
        team = make_team(s, "ticker-settle")
        team_id = team.id
    batch_id = _batch(team_id, BatchStatus.in_progress, expires_in_s=-1, lines=2)
    with unit_of_work() as s:
        s.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch_id)
            .values(state=RequestState.running, claim_token="drain-1", claimed_at=utcnow())
        )
    locked, expired = threading.Event(), threading.Event()

    def drain_records_line_1() -> None:
        with get_engine().begin() as conn:
            conn.execute(
                select(BatchRequest.line)
                .where(BatchRequest.batch_id == batch_id, BatchRequest.line == 1)
                .with_for_update()
            )
            locked.set()
            expired.wait(10)  # the expiry has passed this line by
            time.sleep(0.15)  # the drain's own work before it commits: the tick has looked by now
            conn.execute(
                update(BatchRequest)
                .where(BatchRequest.batch_id == batch_id, BatchRequest.line == 1)
                .values(state=RequestState.succeeded, claim_token=None, finished_at=utcnow())
            )

    drain = threading.Thread(target=drain_records_line_1)
    drain.start()
    assert locked.wait(10)
    sent: list[tuple[TaskName, tuple[str, ...]]] = []

    def enqueue(name: TaskName, /, *args: str) -> None:
        sent.append((name, args))

    original = sweeps.expire_overdue

    def expire_then_release(session: Session) -> list[str]:
        out = original(session)
        session.commit()  # the expiry is seen; then the drain's record commits
        expired.set()
        return out

    monkeypatch.setattr(sweeps, "expire_overdue", expire_then_release)
    try:
        Ticker(leases=SqlLeaseStore(), enqueue=enqueue, drains=0).tick()
    finally:
        expired.set()
        drain.join()
    with unit_of_work() as s:
        states = s.execute(select(BatchRequest.line, BatchRequest.state).where(BatchRequest.batch_id == batch_id)).all()
    assert sorted(states) == [(1, RequestState.succeeded), (2, RequestState.expired)]
    assert (TaskName.finalize_batch, (batch_id,)) in sent


def test_nudges_of_batches_that_finished_are_forgotten(scratch_db: str) -> None:
    """The ticker remembers when it last nudged each batch, to space nudges out: once a batch
    no longer needs nudging (it finished), it must be forgotten, or a scheduler running for
    months holds an entry for every batch it ever finalized or validated."""
    with unit_of_work() as s:
        team = make_team(s, "ticker-forget")
        team_id = team.id
    finalizing = [_batch(team_id, BatchStatus.finalizing) for _ in range(3)]
    validating = _batch(team_id, BatchStatus.validating, age_s=60)
    ticker = Ticker(leases=SqlLeaseStore(), enqueue=lambda name, /, *args: None, drains=0)
    ticker.tick()
    assert {b for _, b in ticker._nudged} >= {*finalizing, validating}
    with unit_of_work() as s:
        s.execute(update(Batch).where(Batch.id.in_([*finalizing, validating])).values(status=BatchStatus.completed))
    ticker.tick()
    assert not {b for _, b in ticker._nudged} & {*finalizing, validating}, ticker._nudged


def test_a_leader_whose_tick_is_blocked_in_the_database_hands_over(scratch_db: str, redis_url: str) -> None:
    """A tick blocked on a row lock (held here, as by a stuck transaction or a dead connection's
    lock) keeps its thread alive but makes no progress: the leader must stop renewing its lease,
    a standby must lead within 3 TTLs, and the stuck leader, once unblocked, must stop at its next
    step and not lead again."""
    import threading
    import uuid

    import psycopg

    from backfill.scheduler.leadership import RedisLeaderLease, lead_while_leader
    from tests.e2e.helpers import wait_until

    ttl_s = 4.0
    with unit_of_work() as s:
        team = make_team(s, "ticker-blocked")
        team_id = team.id
    overdue = _batch(team_id, BatchStatus.in_progress, expires_in_s=-1, lines=1)
    blocker = psycopg.connect(scratch_db.replace("postgresql+psycopg://", "postgresql://"))
    blocker.execute("SELECT id FROM batches WHERE id = %s FOR UPDATE", (overdue,))  # held until rollback

    ns = f"t-{uuid.uuid4().hex[:8]}"
    stuck, standby = (RedisLeaderLease(redis_url, ttl_s=ttl_s, namespace=ns) for _ in range(2))
    stop = threading.Event()
    terms: list[str] = []

    def lead(deposed: Callable[[], bool]) -> None:
        terms.append(stuck.token)
        Ticker(leases=SqlLeaseStore(), enqueue=lambda name, /, *args: None, drains=0).run_forever(0.2, stop=deposed)

    def keep_standby() -> None:
        while not stop.wait(1.0):
            standby.renew()

    standby_keeper = threading.Thread(target=keep_standby, daemon=True)
    leader = threading.Thread(
        target=lead_while_leader,
        args=(stuck, lead),
        kwargs={"stop": stop.is_set, "poll_s": 0.2, "progress_timeout_s": ttl_s / 2},
        daemon=True,
    )
    try:
        leader.start()
        wait_until("the first replica leads", lambda: bool(terms), timeout_s=30, every_s=0.05)
        takeover_s = wait_until("the standby leads", standby.try_acquire, timeout_s=3 * ttl_s, every_s=0.2)
        print(f"hung-leader: ttl_s={ttl_s} progress_timeout_s={ttl_s / 2} takeover_s={takeover_s:.1f}")
        standby_keeper.start()
        blocker.rollback()  # the stuck tick goes on: its next step finds it no longer leads
        wait_until("the stuck replica stands by", lambda: not stuck.held(), timeout_s=30)
        assert standby.renew() and stuck.holder() == standby.token
        assert len(terms) == 1, "the stuck replica led again while the standby held the lease"
    finally:
        stop.set()
        blocker.close()
        leader.join(timeout=30)
