"""Capacity leases and worker heartbeats with a time-to-live, shared by every worker.

Redis in production (a sorted set per pool, scored by expiry, changed atomically in Lua);
the database in the embedded mode. A dead worker's leases lapse by themselves.

Redis may come back empty (restarted without persistence) while drains still hold requests in
flight. The store then notices that its epoch key is gone: for one lease TTL it grants nothing
new and renewals re-create the leases they name, so every live holder (renewing every third of
a TTL) re-asserts what it holds before anyone may take more, and the limit holds across the
restart.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from sqlalchemy import Float, String, delete, func, select, update
from sqlalchemy.orm import Mapped, mapped_column

from backfill.storage.db import Base, unit_of_work

log = logging.getLogger("backfill.leases")


class Lease(Base):
    """Capacity leases and worker heartbeats for the embedded mode (Redis holds them in production)."""

    __tablename__ = "leases"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(320), index=True)  # "pool:" + a pool name (a model in it)
    expires_at: Mapped[float] = mapped_column(Float)


# The store's names, one owner for every reader and writer (drains, the controller, the ticker,
# the dashboard): a pool of leases per fleet deployment (per model where a deployment serves
# several), the pool of running drains, and the values the capacity controller publishes for a
# pool (its limit, shed target, KV budget and latency observations) or for the whole fleet.
FLEET_POOL = "fleet"
DRAIN_POOL = "drains"
RATE_KEY = "rate:fleet"  # batch tokens/s (prompt + output) the fleet currently gives batch work


def pool_name(deployment: int, model: str | None = None) -> str:
    """The lease pool of a deployment (by its index in the fleet client's order), or of one
    model's pool on it."""
    base = FLEET_POOL if deployment == 0 else f"{FLEET_POOL}:{deployment}"
    return base if model is None else f"{base}/{model}"


def limit_key(pool: str) -> str:
    return f"limit:{pool}"


def shed_key(pool: str) -> str:
    return f"shed:{pool}"


def kv_key(pool: str) -> str:
    return f"kv:{pool}"


def obs_key(pool: str) -> str:
    return f"obs:{pool}"


class LeaseStore(Protocol):
    def acquire(self, pool: str, *, limit: int, n: int, ttl_s: float, settle: bool = True) -> list[str]: ...
    def renew(self, pool: str, lease_ids: list[str], *, ttl_s: float) -> None: ...
    def release(self, pool: str, lease_ids: list[str]) -> None: ...
    def count(self, pool: str) -> int: ...
    def heartbeat(self, holder: str, *, ttl_s: float) -> None: ...
    def alive(self, holders: list[str]) -> set[str]: ...
    def publish(self, name: str, value: str, *, ttl_s: float) -> None: ...
    def read(self, name: str) -> str | None: ...
    def withdraw(self, name: str) -> None: ...


# KEYS[1] the pool, KEYS[2] the epoch; ARGV[1] the TTL, ARGV[2] how long to settle after a loss.
# The epoch is the time this namespace's data was first seen; when it is missing, Redis lost
# its data (or this is its first use): for the settle time from then the store is recovering.
_EPOCH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local epoch = tonumber(redis.call('GET', KEYS[2]) or '')
if not epoch then
  epoch = now
  redis.call('SET', KEYS[2], tostring(now))
end
local recovering = now - epoch < tonumber(ARGV[2])
"""

# ARGV[3] limit, ARGV[4] n, then n fresh ids.
_ACQUIRE = (
    _EPOCH
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if recovering then
  return {}
end
local free = tonumber(ARGV[3]) - redis.call('ZCARD', KEYS[1])
local want = math.min(tonumber(ARGV[4]), free)
local granted = {}
for i = 1, want do
  local id = ARGV[4 + i]
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), id)
  granted[#granted + 1] = id
end
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 1000) + 1000)
return granted
"""
)

# ARGV[3..] the lease ids. Normally only leases that still exist are extended (a lease that
# lapsed or was released stays gone); while recovering, renewal re-creates them.
_RENEW = (
    _EPOCH
    + """
local flag = recovering and 'GT' or 'XX'
for i = 3, #ARGV do
  redis.call('ZADD', KEYS[1], flag, now + tonumber(ARGV[1]), ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 1000) + 1000)
return recovering and 1 or 0
"""
)

_COUNT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""


class RedisLeaseStore:
    def __init__(self, url: str, *, namespace: str = "backfill", settle_s: float = 0.0) -> None:
        import redis

        # Bounded waits: a Redis that stops answering fails a call (which its caller handles as
        # an outage) instead of hanging a drain or the loop.
        self.r = redis.Redis.from_url(
            url, decode_responses=True, socket_connect_timeout=2.0, socket_timeout=5.0, health_check_interval=30
        )
        self.ns = namespace
        # The capacity lease TTL for the process-wide store (`get_lease_store`); 0 for a store
        # made for one test or tool, so a fresh namespace need not wait before its first grant.
        self.settle_s = settle_s
        self._acquire = self.r.register_script(_ACQUIRE)
        self._renew = self.r.register_script(_RENEW)
        self._count = self.r.register_script(_COUNT)

    def _pool(self, pool: str) -> str:
        return f"{self.ns}:lease:{pool}"

    def _keys(self, pool: str) -> list[str]:
        return [self._pool(pool), f"{self.ns}:epoch"]

    def acquire(self, pool: str, *, limit: int, n: int, ttl_s: float, settle: bool = True) -> list[str]:
        """Up to n new leases within `limit`; none while the store recovers from a loss of its
        data, unless `settle` is off (for pools where a second holder only wastes work)."""
        ids = [uuid.uuid4().hex for _ in range(max(n, 0))]
        if not ids:
            return []
        args: list[str | float] = [ttl_s, self.settle_s if settle else 0.0, limit, n, *ids]
        return list(self._acquire(keys=self._keys(pool), args=args))

    def renew(self, pool: str, lease_ids: list[str], *, ttl_s: float) -> None:
        if lease_ids and self._renew(keys=self._keys(pool), args=[ttl_s, self.settle_s, *lease_ids]):
            log.warning(
                "lease store recovering from a loss of its data: re-asserted %d %s leases", len(lease_ids), pool
            )

    def release(self, pool: str, lease_ids: list[str]) -> None:
        if lease_ids:
            self.r.zrem(self._pool(pool), *lease_ids)

    def count(self, pool: str) -> int:
        return int(self._count(keys=[self._pool(pool)]))

    def heartbeat(self, holder: str, *, ttl_s: float) -> None:
        self.r.set(f"{self.ns}:hb:{holder}", "1", px=int(ttl_s * 1000))

    def alive(self, holders: list[str]) -> set[str]:
        if not holders:
            return set()
        values = self.r.mget([f"{self.ns}:hb:{h}" for h in holders])
        return {h for h, v in zip(holders, values, strict=True) if v is not None}

    def publish(self, name: str, value: str, *, ttl_s: float) -> None:
        self.r.set(f"{self.ns}:val:{name}", value, px=int(ttl_s * 1000))

    def read(self, name: str) -> str | None:
        value = self.r.get(f"{self.ns}:val:{name}")
        return str(value) if value is not None else None

    def withdraw(self, name: str) -> None:
        self.r.delete(f"{self.ns}:val:{name}")


class SqlLeaseStore:
    """Same contract on the database, for the embedded mode (one machine, no Redis)."""

    def acquire(self, pool: str, *, limit: int, n: int, ttl_s: float, settle: bool = True) -> list[str]:
        now = time.time()
        with unit_of_work() as s:
            if s.get_bind().dialect.name == "postgresql":
                # Count-then-insert is atomic only if acquirers of a pool take turns: a lock per
                # pool, held to the commit. (SQLite's first write locks the whole database.)
                s.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"backfill:pool:{pool}"))))
            s.execute(delete(Lease).where(Lease.kind == f"pool:{pool}", Lease.expires_at <= now))
            held = s.execute(select(func.count()).where(Lease.kind == f"pool:{pool}")).scalar_one()
            ids = [uuid.uuid4().hex for _ in range(max(0, min(n, limit - held)))]
            for lease_id in ids:
                s.add(Lease(id=lease_id, kind=f"pool:{pool}", expires_at=now + ttl_s))
            return ids

    def renew(self, pool: str, lease_ids: list[str], *, ttl_s: float) -> None:
        if lease_ids:
            with unit_of_work() as s:
                s.execute(update(Lease).where(Lease.id.in_(lease_ids)).values(expires_at=time.time() + ttl_s))

    def release(self, pool: str, lease_ids: list[str]) -> None:
        if lease_ids:
            with unit_of_work() as s:
                s.execute(delete(Lease).where(Lease.id.in_(lease_ids)))

    def count(self, pool: str) -> int:
        with unit_of_work() as s:
            return int(
                s.execute(
                    select(func.count()).where(Lease.kind == f"pool:{pool}", Lease.expires_at > time.time())
                ).scalar_one()
            )

    def _put(self, key: str, kind: str, ttl_s: float) -> None:
        with unit_of_work() as s:
            s.merge(Lease(id=key, kind=kind, expires_at=time.time() + ttl_s))

    def heartbeat(self, holder: str, *, ttl_s: float) -> None:
        self._put(f"hb:{holder}", "hb", ttl_s)

    def alive(self, holders: list[str]) -> set[str]:
        if not holders:
            return set()
        with unit_of_work() as s:
            rows = s.execute(
                select(Lease.id).where(Lease.id.in_([f"hb:{h}" for h in holders]), Lease.expires_at > time.time())
            ).scalars()
            return {r[3:] for r in rows}

    def publish(self, name: str, value: str, *, ttl_s: float) -> None:
        # The value rides in the id column after a separator: the table stays a plain TTL map.
        with unit_of_work() as s:
            s.execute(delete(Lease).where(Lease.kind == f"val:{name}"))
            s.add(Lease(id=f"val:{name}:{value}"[:64], kind=f"val:{name}", expires_at=time.time() + ttl_s))

    def read(self, name: str) -> str | None:
        with unit_of_work() as s:
            row = s.execute(
                select(Lease.id).where(Lease.kind == f"val:{name}", Lease.expires_at > time.time())
            ).scalar_one_or_none()
            return row[len(f"val:{name}:") :] if row else None

    def withdraw(self, name: str) -> None:
        with unit_of_work() as s:
            s.execute(delete(Lease).where(Lease.kind == f"val:{name}"))


_store: LeaseStore | None = None


def get_lease_store() -> LeaseStore:
    global _store
    if _store is None:
        from backfill.storage.settings import get_settings

        s = get_settings()
        _store = RedisLeaseStore(s.redis_url, settle_s=s.lease_ttl_s) if s.redis_url else SqlLeaseStore()
    return _store


@contextmanager
def exclusive_lease(leases: LeaseStore, pool: str, *, ttl_s: float) -> Iterator[bool]:
    """Hold the only lease of `pool` while the block runs (renewed in a thread), or yield False
    at once if another holder has it. A holder that dies stops renewing and the lease lapses."""
    # No settling after a loss of the store's data: two holders at once only waste work here.
    ids = leases.acquire(pool, limit=1, n=1, ttl_s=ttl_s, settle=False)
    if not ids:
        yield False
        return
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl_s / 3):
            try:
                leases.renew(pool, ids, ttl_s=ttl_s)
            except Exception:
                log.warning("could not renew lease %s", pool, exc_info=True)

    keeper = threading.Thread(target=renew, name=f"lease:{pool}", daemon=True)
    keeper.start()
    try:
        yield True
    finally:
        stop.set()
        keeper.join()
        leases.release(pool, ids)


def released_limit(
    store: LeaseStore, pool: str, *, controlled: bool, fixed_limit: int, floor: int, fallback_pool: str | None = None
) -> int:
    """The batch requests a pool may hold now: the fixed bound when the controller is off;
    else what the controller published for the pool (or for `fallback_pool`, a model's pool's
    deployment, when the model has no controller of its own), failing closed to the floor
    when nothing fresh was published."""
    if not controlled:
        return fixed_limit
    published = store.read(limit_key(pool))
    if published is None and fallback_pool is not None:
        published = store.read(limit_key(fallback_pool))
    return int(published) if published is not None and published.isdigit() else floor
