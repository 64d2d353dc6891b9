"""Which scheduler replica runs the loop and the capacity controllers: a leader lease.

Every replica runs `lead_while_leader`; one holds the lease and leads, the others stand by and
try again every `poll_s`. The holder renews every third of the TTL; a holder that dies stops
renewing and a standby takes over once the lease lapses (TTL + `poll_s` at most).

Two leaders must never act at once, even when the old one is frozen (a GC pause, a stopped
container) rather than dead. So a holder counts itself leader only until `valid_until`: the
time it sent its last successful acquire or renew, plus the TTL, less a margin. The store's own
expiry runs from when it received that request, later, so the holder's belief ends first. The
controllers' publications are also fenced in the store itself (`FencedLeases`): Redis writes a
value only while the writer's token still holds the lease.

A leader that is alive but stuck (a tick blocked on a dead connection or a lock) must hand over
too: the loop asks `deposed()` between its steps, each ask counts as progress, and the keeper
renews only while the last one is at most `progress_timeout_s` old. A stuck loop's lease lapses
as a dead one's does; when the loop comes back, its next ask says it is deposed.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from backfill.storage.db import unit_of_work
from backfill.storage.leases import Lease, LeaseStore, get_lease_store
from backfill.storage.settings import Settings

log = logging.getLogger("backfill.leader")

LEADER_NAME = "scheduler"


class LeaderLease(Protocol):
    token: str
    ttl_s: float

    def try_acquire(self) -> bool: ...
    def renew(self) -> bool: ...
    def release(self) -> None: ...
    def held(self) -> bool: ...
    def holder(self) -> str | None: ...
    def publish(self, key: str, value: str, *, ttl_s: float, term: str) -> bool: ...
    def withdraw(self, key: str, *, term: str) -> bool: ...


class _Validity:
    """The holder's own clock on the lease: valid until the last request's send time + TTL - margin."""

    def __init__(self, ttl_s: float, margin_s: float) -> None:
        self.ttl_s = ttl_s
        self.margin_s = margin_s
        self.valid_until = 0.0

    def granted(self, sent_at: float) -> None:
        self.valid_until = sent_at + self.ttl_s - self.margin_s

    def lost(self) -> None:
        self.valid_until = 0.0

    def held(self) -> bool:
        return time.monotonic() < self.valid_until


_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# KEYS[1] the leader key, KEYS[2] the value's key; ARGV[1] token, ARGV[2] value, ARGV[3] TTL ms.
_FENCED_SET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""
_FENCED_DEL = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[2])
return 1
"""


class RedisLeaderLease:
    """The lease as one Redis key holding the leader's token (SET NX PX), renewed and released
    only by that token (Lua compare-and-set)."""

    def __init__(self, url: str, *, name: str = LEADER_NAME, ttl_s: float = 6.0, namespace: str = "backfill") -> None:
        import redis

        self.r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=max(1.0, ttl_s / 3))
        self.key = f"{namespace}:leader:{name}"
        self.ns = namespace
        self.token = uuid.uuid4().hex
        self.ttl_s = ttl_s
        self.ttl_ms = int(ttl_s * 1000)
        self._validity = _Validity(ttl_s, margin_s=min(1.0, ttl_s / 4))
        self._renew = self.r.register_script(_RENEW)
        self._release = self.r.register_script(_RELEASE)
        self._fenced_set = self.r.register_script(_FENCED_SET)
        self._fenced_del = self.r.register_script(_FENCED_DEL)

    def try_acquire(self) -> bool:
        sent = time.monotonic()
        token = uuid.uuid4().hex  # a new token each term: a previous term's stragglers are fenced out
        if self.r.set(self.key, token, nx=True, px=self.ttl_ms):
            self.token = token
            self._validity.granted(sent)
            return True
        return False

    def renew(self) -> bool:
        sent = time.monotonic()
        if self._renew(keys=[self.key], args=[self.token, self.ttl_ms]):
            self._validity.granted(sent)
            return True
        self._validity.lost()
        return False

    def release(self) -> None:
        self._validity.lost()
        self._release(keys=[self.key], args=[self.token])

    def held(self) -> bool:
        return self._validity.held()

    def holder(self) -> str | None:
        value = self.r.get(self.key)
        return str(value) if value is not None else None

    def _val(self, key: str) -> str:
        return f"{self.ns}:val:{key}"  # the same key `RedisLeaseStore.publish` writes

    def publish(self, key: str, value: str, *, ttl_s: float, term: str) -> bool:
        if term != self.token or not self.held():
            return False
        return bool(self._fenced_set(keys=[self.key, self._val(key)], args=[term, value, int(ttl_s * 1000)]))

    def withdraw(self, key: str, *, term: str) -> bool:
        return bool(self._fenced_del(keys=[self.key, self._val(key)], args=[term]))


class SqlLeaderLease:
    """The same on the database, for the embedded mode: one `leases` row whose kind names the
    holder's token."""

    def __init__(self, leases: LeaseStore, *, name: str = LEADER_NAME, ttl_s: float = 6.0) -> None:
        self.leases = leases
        self.id = f"leader:{name}"
        self.token = uuid.uuid4().hex
        self.ttl_s = ttl_s
        self._validity = _Validity(ttl_s, margin_s=min(1.0, ttl_s / 4))

    @property
    def kind(self) -> str:
        return f"leader:{self.token}"

    def try_acquire(self) -> bool:
        sent = time.monotonic()
        token = uuid.uuid4().hex  # a new token each term, as in Redis
        try:
            with unit_of_work() as s:
                s.execute(delete(Lease).where(Lease.id == self.id, Lease.expires_at <= time.time()))
                if s.get(Lease, self.id) is not None:
                    return False
                s.add(Lease(id=self.id, kind=f"leader:{token}", expires_at=time.time() + self.ttl_s))
        except IntegrityError:  # another replica inserted it first
            return False
        self.token = token
        self._validity.granted(sent)
        return True

    def renew(self) -> bool:
        sent = time.monotonic()
        with unit_of_work() as s:
            done = s.execute(
                update(Lease)
                .where(Lease.id == self.id, Lease.kind == self.kind, Lease.expires_at > time.time())
                .values(expires_at=time.time() + self.ttl_s)
            )
            ok = bool(getattr(done, "rowcount", 0))
        if ok:
            self._validity.granted(sent)
        else:
            self._validity.lost()
        return ok

    def release(self) -> None:
        self._validity.lost()
        with unit_of_work() as s:
            s.execute(delete(Lease).where(Lease.id == self.id, Lease.kind == self.kind))

    def held(self) -> bool:
        return self._validity.held()

    def holder(self) -> str | None:
        with unit_of_work() as s:
            kind = s.execute(
                select(Lease.kind).where(Lease.id == self.id, Lease.expires_at > time.time())
            ).scalar_one_or_none()
        return kind.removeprefix("leader:") if kind else None

    def publish(self, key: str, value: str, *, ttl_s: float, term: str) -> bool:
        if term != self.token or not self.held():
            return False
        self.leases.publish(key, value, ttl_s=ttl_s)
        return True

    def withdraw(self, key: str, *, term: str) -> bool:
        if term != self.token or not self.held():
            return False
        self.leases.withdraw(key)
        return True


class FencedLeases:
    """A `LeaseStore` for the capacity controllers of one term: leases and reads pass through; a
    value is published only while the term it was made in still leads (a deposed leader's write,
    or a straggling thread's from an earlier term of this replica, is dropped)."""

    def __init__(self, inner: LeaseStore, leader: LeaderLease) -> None:
        self.inner = inner
        self.leader = leader
        self.term = leader.token
        self.dropped = 0

    def acquire(self, pool: str, *, limit: int, n: int, ttl_s: float, settle: bool = True) -> list[str]:
        return self.inner.acquire(pool, limit=limit, n=n, ttl_s=ttl_s, settle=settle)

    def renew(self, pool: str, lease_ids: list[str], *, ttl_s: float) -> None:
        self.inner.renew(pool, lease_ids, ttl_s=ttl_s)

    def release(self, pool: str, lease_ids: list[str]) -> None:
        self.inner.release(pool, lease_ids)

    def count(self, pool: str) -> int:
        return self.inner.count(pool)

    def heartbeat(self, holder: str, *, ttl_s: float) -> None:
        self.inner.heartbeat(holder, ttl_s=ttl_s)

    def alive(self, holders: list[str]) -> set[str]:
        return self.inner.alive(holders)

    def publish(self, name: str, value: str, *, ttl_s: float) -> None:
        if not self.leader.publish(name, value, ttl_s=ttl_s, term=self.term):
            self.dropped += 1
            log.warning("not the leader any more: dropped the publication of %s", name)

    def read(self, name: str) -> str | None:
        return self.inner.read(name)

    def withdraw(self, name: str) -> None:
        self.leader.withdraw(name, term=self.term)


class AliveFile:
    """A file whose modification time says when the scheduler last made progress (at most once
    a second), for a liveness probe: `backfill scheduler-alive` reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last >= 1.0:
            self._last = now
            self.path.touch()

    @staticmethod
    def age_s(path: Path) -> float:
        return time.time() - path.stat().st_mtime


def leader_lease(s: Settings) -> LeaderLease:
    """This process's view of the scheduler lease: Redis in production, the database embedded."""
    if s.redis_url:
        return RedisLeaderLease(s.redis_url, ttl_s=s.scheduler_leader_ttl_s)
    return SqlLeaderLease(get_lease_store(), ttl_s=s.scheduler_leader_ttl_s)


def lead_while_leader(
    lease: LeaderLease,
    lead: Callable[[Callable[[], bool]], None],
    *,
    stop: Callable[[], bool],
    poll_s: float = 1.0,
    renew_every_s: float | None = None,
    progress_timeout_s: float | None = None,
    alive: Callable[[], None] = lambda: None,
) -> None:
    """Stand by until this replica holds `lease`, then run `lead(deposed)`, where `deposed()`
    turns true when the process is stopping or the lease is lost; `lead` must return soon
    after. Then stand by again, until `stop()`. `lead` asks `deposed()` at least every
    `progress_timeout_s` (by default 3 TTLs), or the lease is let go. `alive()` is called at
    each standby poll and each ask: a liveness probe watches it."""
    every = renew_every_s or lease.ttl_s / 3
    progress_s = progress_timeout_s or 3 * lease.ttl_s
    while not stop():
        alive()
        try:
            acquired = lease.try_acquire()
        except Exception:
            log.warning("could not reach the leader lease's store", exc_info=True)
            acquired = False
        if not acquired:
            time.sleep(poll_s)
            continue
        log.info("this scheduler leads now (token %s)", lease.token[:8])
        _lead_once(lease, lead, stop=stop, renew_every_s=every, progress_timeout_s=progress_s, alive=alive)


def _lead_once(
    lease: LeaderLease,
    lead: Callable[[Callable[[], bool]], None],
    *,
    stop: Callable[[], bool],
    renew_every_s: float,
    progress_timeout_s: float,
    alive: Callable[[], None],
) -> None:
    """Run `lead` while a keeper thread renews the lease, as long as `lead` keeps asking whether
    it is deposed; release the lease when `lead` returns."""
    lost = threading.Event()
    done = threading.Event()
    last_ask = [time.monotonic()]

    def deposed() -> bool:
        last_ask[0] = time.monotonic()
        alive()
        return stop() or lost.is_set() or not lease.held()

    def keep() -> None:
        while not done.wait(renew_every_s):
            stuck_s = time.monotonic() - last_ask[0]
            if stuck_s > progress_timeout_s:
                # Renewing now would keep a stuck loop's lease for ever: let it lapse instead.
                log.error(
                    "the scheduler loop has made no progress for %.0f s: no longer renewing the leader lease",
                    stuck_s,
                )
                lost.set()
                return
            try:
                if lease.renew():
                    continue
            except Exception:
                log.warning("could not renew the leader lease", exc_info=True)
                if lease.held():
                    continue  # still inside its validity: try again
            lost.set()
            return

    keeper = threading.Thread(target=keep, name="leader-lease", daemon=True)
    keeper.start()
    try:
        lead(deposed)
    finally:
        done.set()
        keeper.join()
        # Whichever noticed first: the keeper's renewal refused, or the loop's own clock (a leader
        # resumed after a pause asks `deposed()` before its keeper wakes to renew).
        if lost.is_set() or (not stop() and not lease.held()):
            log.warning("lost the leader lease: standing by")
        try:
            lease.release()
        except Exception:
            log.warning("could not release the leader lease (it lapses by itself)", exc_info=True)
