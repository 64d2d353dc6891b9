"""The scheduler's leader lease on both stores: one leader at a time, a standby that takes over
when the leader stops renewing, and publications fenced to the current leader."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from backfill.scheduler.leadership import (
    FencedLeases,
    LeaderLease,
    RedisLeaderLease,
    SqlLeaderLease,
    lead_while_leader,
)
from backfill.storage.leases import LeaseStore, RedisLeaseStore, SqlLeaseStore
from backfill.storage.process_state import reset as reset_process_state

REDIS = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/10"
TTL_S = 3.0  # seconds, not fractions: a loaded machine's SQLite commit must not outlast it


@pytest.fixture(params=["redis", "sql"])
def make(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[], tuple[LeaderLease, LeaseStore]]]:
    """A factory of replicas: each call is another scheduler's view of the same lease."""
    if request.param == "redis":
        ns = f"t-{uuid.uuid4().hex[:8]}"

        def redis_replica() -> tuple[LeaderLease, LeaseStore]:
            return RedisLeaderLease(REDIS, ttl_s=TTL_S, namespace=ns), RedisLeaseStore(REDIS, namespace=ns)

        yield redis_replica
        return
    from backfill.migrate import upgrade

    monkeypatch.setenv("BACKFILL_HOME", str(tmp_path_factory.mktemp("leader")))
    monkeypatch.delenv("BACKFILL_DATABASE_URL", raising=False)
    reset_process_state()
    upgrade()

    def sql_replica() -> tuple[LeaderLease, LeaseStore]:
        store = SqlLeaseStore()
        return SqlLeaderLease(store, ttl_s=TTL_S), store

    yield sql_replica
    reset_process_state()


def test_one_leader_until_it_stops_renewing(make: Callable[[], tuple[LeaderLease, LeaseStore]]) -> None:
    (a, _), (b, _) = make(), make()
    assert a.try_acquire() and a.held()
    assert not b.try_acquire() and not b.held()
    assert a.renew() and a.holder() == a.token
    assert not b.try_acquire()
    time.sleep(TTL_S + 0.5)  # a dies: no renewal; its own clock says it no longer leads, first
    assert not a.held()
    assert b.try_acquire() and b.holder() == b.token
    assert not a.renew(), "a deposed leader must not win its lease back by renewing"
    assert not a.held()


def test_a_deposed_leader_cannot_publish(make: Callable[[], tuple[LeaderLease, LeaseStore]]) -> None:
    (a, store_a), (b, _) = make(), make()
    assert a.try_acquire()
    fenced_a = FencedLeases(store_a, a)
    fenced_a.publish("limit", "7", ttl_s=60)
    assert store_a.read("limit") == "7"
    time.sleep(TTL_S + 0.5)
    assert b.try_acquire()
    fenced_a.publish("limit", "99", ttl_s=60)  # a woke up from a pause and tries to publish
    fenced_a.withdraw("limit")
    assert fenced_a.dropped == 1
    assert store_a.read("limit") == "7"
    FencedLeases(store_a, b).publish("limit", "8", ttl_s=60)
    assert store_a.read("limit") == "8"


def test_redis_fencing_holds_even_while_the_deposed_leaders_clock_says_it_leads() -> None:
    """A paused leader can believe it leads for a moment; the store itself refuses its write."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a, b = RedisLeaderLease(REDIS, ttl_s=30, namespace=ns), RedisLeaderLease(REDIS, ttl_s=30, namespace=ns)
    store = RedisLeaseStore(REDIS, namespace=ns)
    assert a.try_acquire()
    a.r.delete(a.key)  # as if a's lease lapsed during a pause that a's clock did not see
    assert b.try_acquire()
    assert a.held()
    assert a.publish("limit", "99", ttl_s=60, term=a.token) is False
    assert b.publish("limit", "5", ttl_s=60, term=b.token) is True
    assert store.read("limit") == "5"


def test_a_straggler_from_an_earlier_term_cannot_publish(make: Callable[[], tuple[LeaderLease, LeaseStore]]) -> None:
    """A replica that lost its lease and won it again: what its previous term's controller thread
    still tries to publish is dropped, though the replica leads again."""
    (a, store), (b, _) = make(), make()
    assert a.try_acquire()
    old_term = FencedLeases(store, a)
    a.release()
    assert b.try_acquire()
    b.release()
    assert a.try_acquire()  # a leads again, in a new term
    new_term = FencedLeases(store, a)
    old_term.publish("limit", "99", ttl_s=60)
    assert old_term.dropped == 1
    new_term.publish("limit", "3", ttl_s=60)
    assert new_term.dropped == 0 and store.read("limit") == "3"


def test_standby_takes_over_and_leaders_never_overlap(make: Callable[[], tuple[LeaderLease, LeaseStore]]) -> None:
    """Two replicas run the election; the leader's process 'dies' (its renewals stop, as when it is
    SIGKILLed); the standby leads within TTL + poll, and the two leadership intervals never overlap."""
    spans: list[tuple[str, float, float]] = []
    dead = threading.Event()
    stop = threading.Event()

    def replica(name: str) -> None:
        lease, _ = make()
        if name == "first":
            # SIGKILL, as the store sees it: from `dead` on, every call this replica makes fails.
            for method in ("try_acquire", "renew", "release"):
                real = getattr(lease, method)

                def gone(real: Callable[[], object] = real) -> object:
                    if dead.is_set():
                        raise ConnectionError("process gone")
                    return real()

                setattr(lease, method, gone)

        def lead(deposed: Callable[[], bool]) -> None:
            start = time.monotonic()
            while not deposed():
                time.sleep(0.05)
            spans.append((name, start, time.monotonic()))

        lead_while_leader(lease, lead, stop=stop.is_set, poll_s=0.2)

    first = threading.Thread(target=replica, args=("first",), daemon=True)
    first.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not spans and not first.is_alive():
        time.sleep(0.05)
    time.sleep(1.0)  # first leads
    second = threading.Thread(target=replica, args=("second",), daemon=True)
    second.start()
    time.sleep(1.0)
    died_at = time.monotonic()
    dead.set()
    deadline = time.monotonic() + 4 * TTL_S
    while time.monotonic() < deadline and not any(n == "first" for n, *_ in spans):
        time.sleep(0.05)
    time.sleep(TTL_S + 1.5)  # long enough for the standby to take over
    stop.set()
    first.join(timeout=10)
    second.join(timeout=10)
    by_name = {n: (s, e) for n, s, e in spans}
    assert set(by_name) == {"first", "second"}, spans
    assert by_name["first"][1] <= by_name["second"][0], f"two leaders at once: {spans}"
    assert by_name["second"][0] - died_at <= TTL_S + 1.5, "the standby took too long to take over"


def test_the_liveness_check_reads_the_alive_file(tmp_path: Path) -> None:
    """`backfill scheduler-alive` (the chart's liveness probe) passes while the loop touches its
    file, fails once the file is older than --within-s, and fails before the file exists."""
    from typer.testing import CliRunner

    from backfill.cli import app
    from backfill.scheduler.leadership import AliveFile

    path = tmp_path / "scheduler.alive"
    runner = CliRunner()
    assert runner.invoke(app, ["scheduler-alive", str(path)]).exit_code == 1
    AliveFile(path)()
    assert runner.invoke(app, ["scheduler-alive", str(path), "--within-s", "60"]).exit_code == 0
    old = time.time() - 120
    os.utime(path, (old, old))
    assert runner.invoke(app, ["scheduler-alive", str(path), "--within-s", "60"]).exit_code == 1
