"""The lease contract on both stores: Redis (production) and the database (embedded)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from backfill.storage.leases import LeaseStore, RedisLeaseStore, SqlLeaseStore
from tests.process_env import process_env, scratch_database


@pytest.fixture(params=["redis", "sql"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeaseStore]:
    if request.param == "redis":
        url = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/10"
        yield RedisLeaseStore(url, namespace=f"t-{uuid.uuid4().hex[:8]}")
        return
    from backfill.migrate import upgrade

    # The embedded database under a home of its own.
    with process_env({"BACKFILL_HOME": str(tmp_path_factory.mktemp("leases")), "BACKFILL_DATABASE_URL": None}):
        upgrade()
        yield SqlLeaseStore()


# TTLs are seconds, not fractions of one: on a loaded CI machine a SQLite commit can take
# longer than half a second, and a lease that lapsed before it was checked proved nothing.
SHORT_TTL_S = 3.0


def test_limit_is_shared_and_leases_lapse(store: LeaseStore) -> None:
    first = store.acquire("p", limit=3, n=2, ttl_s=SHORT_TTL_S)
    second = store.acquire("p", limit=3, n=5, ttl_s=SHORT_TTL_S)
    assert len(first) == 2 and len(second) == 1
    assert store.acquire("p", limit=3, n=1, ttl_s=SHORT_TTL_S) == []
    assert store.count("p") == 3
    store.release("p", second)
    assert store.count("p") == 2
    store.renew("p", first[:1], ttl_s=60)
    time.sleep(SHORT_TTL_S + 0.3)  # the unrenewed lease lapses by itself, as a dead worker's would
    assert store.count("p") == 1
    assert len(store.acquire("p", limit=3, n=5, ttl_s=5)) == 2


def test_heartbeats_and_published_values_expire(store: LeaseStore) -> None:
    store.heartbeat("w1", ttl_s=SHORT_TTL_S)
    store.heartbeat("w2", ttl_s=60)
    assert store.alive(["w1", "w2", "w3"]) == {"w1", "w2"}
    store.publish("limit:fleet", "17", ttl_s=SHORT_TTL_S)
    assert store.read("limit:fleet") == "17"
    time.sleep(SHORT_TTL_S + 0.3)
    assert store.alive(["w1", "w2"]) == {"w2"}
    assert store.read("limit:fleet") is None


def test_concurrent_acquirers_on_postgres_never_pass_the_limit(tmp_path: Path) -> None:
    """Drains acquiring at the same moment on Postgres: each counts the pool, then inserts, so
    without one lock per pool two of them pass the same count and the pool holds more than its
    limit. Rounds of many simultaneous acquirers, each wanting more than its share."""
    import threading

    with scratch_database("backfill_leases", tmp_path):
        store = SqlLeaseStore()
        limit, acquirers = 4, 12
        for round_ in range(5):
            pool = f"race-{round_}"
            start = threading.Barrier(acquirers)
            granted: list[list[str]] = []

            def acquire(pool: str = pool, start: threading.Barrier = start, granted: list[list[str]] = granted) -> None:
                start.wait()
                granted.append(store.acquire(pool, limit=limit, n=3, ttl_s=60))

            threads = [threading.Thread(target=acquire) for _ in range(acquirers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sum(map(len, granted)) == limit == store.count(pool), granted


def test_the_published_batch_rate_is_none_while_the_lease_store_is_away() -> None:
    """The planner reads the controller's published rate at each refresh; a Redis restart must
    leave it measuring its own, not raise out of the drain with requests in flight."""
    from backfill.scheduler.capacity.admission import Admission

    away = RedisLeaseStore("redis://127.0.0.1:9/0", namespace=f"away-{uuid.uuid4().hex[:6]}")
    assert Admission(away, fixed_limit=4, ttl_s=3.0).batch_rate() is None
