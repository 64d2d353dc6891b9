"""Reclaiming lines from lapsed drains: an attempt is spent, the cap sends a line to the error file,
and a Redis that restarted empty (every heartbeat and lease gone at once) reclaims nothing from
drains that are alive and lets no lease be granted on top of theirs."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import orjson
import pytest

from backfill.jobs.execution.results import ATTEMPTS_EXCEEDED
from backfill.jobs.models import Batch, BatchRequest, RequestState
from backfill.scheduler.ticker import Reconciler, Ticker
from backfill.storage.broker import TaskName
from backfill.storage.db import unit_of_work
from backfill.storage.leases import DRAIN_POOL, RedisLeaseStore, SqlLeaseStore
from tests.factories import make_batch, make_team
from tests.process_env import scratch_database


@pytest.fixture(scope="module")
def scratch_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A database of its own, used in-process through the usual settings (the code under test
    opens its own units of work); objects in a local directory."""
    unset: dict[str, str | None] = {"BACKFILL_S3_ENDPOINT_URL": None, "BACKFILL_REDIS_URL": None}
    with scratch_database("backfill_faults", tmp_path_factory.mktemp("faults-home"), **unset) as url:
        yield url


def running_batch(lines: int, *, token: str | None = None, attempts: int = 0) -> str:
    """An in-progress batch whose lines are all running under `token` (pending without one)."""
    with unit_of_work() as s:
        state = RequestState.running if token else RequestState.pending
        team = make_team(s)
        return make_batch(
            s, team, lines=lines, expires_in_s=3600, line_state=state, claim_token=token, attempts=attempts
        ).id


def lines_of(batch_id: str) -> list[BatchRequest]:
    with unit_of_work() as s:
        return list(s.query(BatchRequest).filter_by(batch_id=batch_id).order_by(BatchRequest.line))


def test_a_reclaim_spends_an_attempt_and_the_cap_fails_the_line(scratch_db: str) -> None:
    fresh = running_batch(2, token="drain-dead-1")
    worn = running_batch(1, token="drain-dead-2", attempts=2)
    reconciler = Reconciler(leases=SqlLeaseStore(), max_attempts=3, heartbeat_ttl_s=0.0, stall_after_s=60)
    reconciler.reclaim()  # seen missing once: not yet
    assert all(r.state == RequestState.running for r in lines_of(fresh))
    out = reconciler.reclaim()
    assert out.requeued[fresh] == 2 and out.failed[worn] == 1
    assert [(r.state, r.attempts, r.claim_token) for r in lines_of(fresh)] == [(RequestState.pending, 1, None)] * 2
    (poison,) = lines_of(worn)
    assert (poison.state, poison.attempts, poison.status_code) == (RequestState.failed, 3, 500)
    error = orjson.loads(poison.response_body or "")["error"]
    assert error["code"] == ATTEMPTS_EXCEEDED and error["type"] == "server_error" and "3 times" in error["message"]
    with unit_of_work() as s:
        batch = s.get(Batch, worn)
        assert batch is not None and (batch.failed, batch.completed) == (1, 0)


@pytest.fixture
def redis_leases(redis_url: str) -> RedisLeaseStore:
    return RedisLeaseStore(redis_url, namespace=f"rc-{secrets.token_hex(4)}", settle_s=1.0)


def _lose_everything(store: RedisLeaseStore) -> None:
    """What a Redis restarted without persistence looks like to this namespace."""
    keys = list(store.r.scan_iter(f"{store.ns}:*"))
    if keys:
        store.r.delete(*keys)


def test_heartbeats_lost_with_redis_reclaim_nothing_from_live_drains(
    scratch_db: str, redis_leases: RedisLeaseStore
) -> None:
    batch_id = running_batch(3, token="drain-alive")
    redis_leases.heartbeat("drain-alive", ttl_s=3)
    reconciler = Reconciler(leases=redis_leases, max_attempts=3, heartbeat_ttl_s=1.0, stall_after_s=60)
    reconciler.reclaim()
    _lose_everything(redis_leases)
    reconciler.reclaim()  # every heartbeat is gone at once
    time.sleep(0.5)
    reconciler.reclaim()
    redis_leases.heartbeat("drain-alive", ttl_s=3)  # the live drain's keepalive re-asserts it
    time.sleep(0.6)
    out = reconciler.reclaim()
    assert out.total == 0
    assert all(r.state == RequestState.running and r.attempts == 0 for r in lines_of(batch_id))
    # A drain that really died is reclaimed once its heartbeat has been gone for the TTL.
    _lose_everything(redis_leases)
    reconciler.reclaim()
    time.sleep(1.1)
    assert reconciler.reclaim().requeued[batch_id] == 3


def test_a_restarted_redis_grants_nothing_on_top_of_live_leases(redis_leases: RedisLeaseStore) -> None:
    ttl = 3.0
    # Fresh namespace: the first grant waits out the settle time (nobody could hold anything).
    deadline = time.monotonic() + 3
    while not (held := redis_leases.acquire("fleet", limit=4, n=3, ttl_s=ttl)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert len(held) == 3
    _lose_everything(redis_leases)
    assert redis_leases.count("fleet") == 0
    # Within the settle time nothing new is granted, and the holder's renewal brings its leases back.
    assert redis_leases.acquire("fleet", limit=4, n=4, ttl_s=ttl) == []
    redis_leases.renew("fleet", held, ttl_s=ttl)
    assert redis_leases.count("fleet") == 3
    time.sleep(1.1)
    assert len(redis_leases.acquire("fleet", limit=4, n=4, ttl_s=ttl)) == 1  # the limit holds
    # Once settled, renewal no longer resurrects a released lease.
    redis_leases.release("fleet", held[:1])
    redis_leases.renew("fleet", held, ttl_s=ttl)
    assert redis_leases.count("fleet") == 3


def test_a_stalled_batch_with_no_live_drain_gets_one(scratch_db: str, caplog: pytest.LogCaptureFixture) -> None:
    batch_id = running_batch(4)  # all pending, nobody working on them
    leases = SqlLeaseStore()
    # Every drain slot is held (say, by drains killed a moment ago whose slots have not lapsed),
    # so the usual top-up sends nothing: only the reconciler notices the batch is stuck.
    leases.acquire(DRAIN_POOL, limit=2, n=2, ttl_s=60)
    sent: list[tuple[TaskName, tuple[str, ...]]] = []
    reconciler = Reconciler(leases=leases, max_attempts=3, heartbeat_ttl_s=1.0, stall_after_s=0.3)
    ticker = Ticker(
        leases=leases, enqueue=lambda name, *args: sent.append((name, args)), drains=2, reconciler=reconciler
    )
    ticker.tick()
    assert (TaskName.drain, ()) not in sent
    time.sleep(0.4)
    with caplog.at_level("WARNING", logger="backfill.scheduler"):
        ticker.tick()
    assert (TaskName.drain, ()) in sent
    assert any(batch_id in m and "started a drain" in m for m in caplog.messages)
