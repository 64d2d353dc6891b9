"""Capacity leases and worker heartbeats with a time-to-live, shared by every worker.

Redis in production (a sorted set per pool, scored by expiry, changed atomically in Lua);
the database in the embedded mode. A dead worker's leases lapse by themselves.
"""

from __future__ import annotations

import time
import uuid
from typing import Protocol

from sqlalchemy import delete, func, select, update

from jobs.models import Lease
from storage.db import unit_of_work


class LeaseStore(Protocol):
    def acquire(self, pool: str, *, limit: int, n: int, ttl_s: float) -> list[str]: ...
    def renew(self, pool: str, lease_ids: list[str], *, ttl_s: float) -> None: ...
    def release(self, pool: str, lease_ids: list[str]) -> None: ...
    def count(self, pool: str) -> int: ...
    def heartbeat(self, holder: str, *, ttl_s: float) -> None: ...
    def alive(self, holders: list[str]) -> set[str]: ...
    def publish(self, name: str, value: str, *, ttl_s: float) -> None: ...
    def read(self, name: str) -> str | None: ...


_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local free = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[1])
local want = math.min(tonumber(ARGV[2]), free)
local granted = {}
for i = 1, want do
  local id = ARGV[3 + i]
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), id)
  granted[#granted + 1] = id
end
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) * 1000) + 1000)
return granted
"""

_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]) * 1000) + 1000)
return 1
"""

_COUNT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""


class RedisLeaseStore:
    def __init__(self, url: str, *, namespace: str = "backfill") -> None:
        import redis

        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.ns = namespace
        self._acquire = self.r.register_script(_ACQUIRE)
        self._renew = self.r.register_script(_RENEW)
        self._count = self.r.register_script(_COUNT)

    def _pool(self, pool: str) -> str:
        return f"{self.ns}:lease:{pool}"

    def acquire(self, pool: str, *, limit: int, n: int, ttl_s: float) -> list[str]:
        ids = [uuid.uuid4().hex for _ in range(max(n, 0))]
        if not ids:
            return []
        return list(self._acquire(keys=[self._pool(pool)], args=[limit, n, ttl_s, *ids]))

    def renew(self, pool: str, lease_ids: list[str], *, ttl_s: float) -> None:
        if lease_ids:
            self._renew(keys=[self._pool(pool)], args=[ttl_s, *lease_ids])

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


class SqlLeaseStore:
    """Same contract on the database, for the embedded mode (one machine, no Redis)."""

    def acquire(self, pool: str, *, limit: int, n: int, ttl_s: float) -> list[str]:
        now = time.time()
        with unit_of_work() as s:
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


_store: LeaseStore | None = None


def get_lease_store() -> LeaseStore:
    global _store
    if _store is None:
        from storage.settings import get_settings

        url = get_settings().redis_url
        _store = RedisLeaseStore(url) if url else SqlLeaseStore()
    return _store
