"""Circuit breakers for fleet deployments: one per deployment, shared by every worker.

closed: requests go out. open: nothing goes out until a cool-down has passed. half_open: one
probe at a time goes out; its success closes the breaker, its failure opens it again.
A closed breaker opens on evidence from a short window: at least `min_failures` transient
failures (connection errors, timeouts, 5xx), and either at least `failure_ratio` of the
window's calls failed or nothing but failures came back since the last success (a deployment
that just died still has a window full of good answers from before). A streak is evidence once
it is confirmed: `min_failures` of its failures were sent after it began, or it has lasted
`streak_s`. When one of a deployment's engines dies, the requests it held fail together in one
burst, all sent before the first of them failed, while its other engines go on answering; a
deployment that is down also fails what is sent to it afterwards, and does so at once (a
confirmation by time alone would let a drain pour its pending lines into a dead frontend for
`streak_s`).

With Redis every transition is one Lua script on one hash per deployment, timed by Redis's
clock, so all workers run one state machine: one worker's evidence opens it for all, and only
one probe is out at a time across the fleet of workers. Without Redis (embedded mode) the
breaker lives in the process. If Redis stops answering, a shared breaker falls back to its
process-local twin until Redis answers again, rather than stopping the drain.

Why not a library: purgatory's Redis store writes the state as read-modify-write JSON (two
workers can overwrite each other's transition) and lets every caller through while
half-open; aiobreaker and pybreaker keep shared state through the blocking Redis client and
count only consecutive failures, so a deployment failing 80% of its calls never trips.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Any, Protocol

from redis.exceptions import RedisError

log = logging.getLogger("backfill.breaker")


class BreakerState(StrEnum):
    closed = "closed"
    open = "open"
    half_open = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    window_s: float = 10.0  # failures are judged over this much recent time
    buckets: int = 10  # the window slides in steps of window_s / buckets
    min_failures: int = 5  # never open on fewer failures than this within the window
    failure_ratio: float = 0.5  # open when this share of the window's calls failed
    # Or when only failures came back since the last success (at least min_failures of them),
    # and min_failures of them were sent after the first came back, or they lasted this long.
    streak_s: float = 2.0
    cooldown_s: float = 5.0  # open -> half_open after this long
    probe_ttl_s: float = 30.0  # a probe that never reports frees its slot after this long
    # Each failed probe doubles the cool-down, up to this (0: it never grows), so a deployment
    # that keeps refusing (an overflow provider out of quota) is asked less and less often.
    max_cooldown_s: float = 0.0

    def cooldown_after(self, reopens: int) -> float:
        return min(max(self.cooldown_s, self.max_cooldown_s), self.cooldown_s * 2.0**reopens)

    @property
    def key_ttl_ms(self) -> int:
        # Long enough that an open breaker outlives its cool-down and probe; an idle one goes.
        longest = max(self.cooldown_s, self.max_cooldown_s)
        return math.ceil(2 * (self.window_s + longest + self.probe_ttl_s) * 1000)


@dataclass(frozen=True)
class Permit:
    allowed: bool
    probe: bool = False  # the half-open probe: report its outcome with probe=True
    retry_after_s: float = 0.0  # when not allowed: how long until it may be asked again


class Breaker(Protocol):
    name: str
    policy: BreakerPolicy

    async def allow(self) -> Permit: ...

    async def record(self, *, ok: bool, probe: bool = False, sent_s_ago: float = 0.0) -> BreakerState | None:
        """Report a call's outcome (sent `sent_s_ago` seconds before this report); returns the
        new state when this report changed it."""
        ...

    async def state(self) -> BreakerState: ...

    async def flush(self) -> None:
        """Report what is still held back (successes counted together), before closing."""
        ...


class LocalBreaker:
    """The state machine in this process (embedded mode, and the fallback while Redis is away)."""

    def __init__(self, name: str, policy: BreakerPolicy | None = None) -> None:
        self.name = name
        self.policy = policy or BreakerPolicy()
        self._state = BreakerState.closed
        self._opened_at = 0.0
        self._cooldown_s = self.policy.cooldown_s
        self._reopens = 0  # failed probes since the breaker last closed
        self._probe_until = 0.0
        self._streak = 0  # failures since the last success
        self._streak_since = 0.0  # when the first of them came back
        self._streak_fresh = 0  # of them, the calls sent after the first came back
        self._counts: dict[int, list[int]] = {}  # bucket -> [calls, failures]

    async def allow(self) -> Permit:
        return self.allow_now()

    async def record(self, *, ok: bool, probe: bool = False, sent_s_ago: float = 0.0) -> BreakerState | None:
        return self.record_now(ok=ok, probe=probe, sent_s_ago=sent_s_ago)

    async def state(self) -> BreakerState:
        return self._state

    async def flush(self) -> None:
        return None

    def allow_now(self) -> Permit:
        now = time.monotonic()
        if self._state is BreakerState.closed:
            return Permit(True)
        if self._state is BreakerState.open:
            wait = self._opened_at + self._cooldown_s - now
            if wait > 0:
                return Permit(False, retry_after_s=wait)
            self._state, self._probe_until = BreakerState.half_open, 0.0
        if now >= self._probe_until:
            self._probe_until = now + self.policy.probe_ttl_s
            return Permit(True, probe=True)
        return Permit(False, retry_after_s=self._probe_until - now)

    def record_now(self, *, ok: bool, probe: bool = False, sent_s_ago: float = 0.0) -> BreakerState | None:
        now = time.monotonic()
        if self._state is BreakerState.half_open:
            if not probe:
                return None  # only the probe's answer speaks for the deployment now
            return self._close() if ok else self._open(now, again=True)
        if self._state is BreakerState.open:
            return None  # a late answer to a call sent before the breaker opened
        p = self.policy
        bucket = math.floor(now / (p.window_s / p.buckets))
        for old in [b for b in self._counts if b <= bucket - p.buckets]:
            del self._counts[old]
        counts = self._counts.setdefault(bucket, [0, 0])
        counts[0] += 1
        if ok:
            self._streak = 0
            return None
        counts[1] += 1
        if self._streak == 0:
            self._streak_since, self._streak_fresh = now, 0
        elif now - sent_s_ago > self._streak_since:
            self._streak_fresh += 1
        self._streak += 1
        calls = sum(c for c, _ in self._counts.values())
        failures = sum(f for _, f in self._counts.values())
        confirmed = self._streak_fresh >= p.min_failures or now - self._streak_since >= p.streak_s
        streak = self._streak >= p.min_failures and confirmed
        if failures >= p.min_failures and (failures >= p.failure_ratio * calls or streak):
            return self._open(now)
        return None

    def _open(self, now: float, *, again: bool = False) -> BreakerState:
        self._state, self._opened_at, self._probe_until = BreakerState.open, now, 0.0
        self._reopens = self._reopens + 1 if again else 0
        self._cooldown_s = self.policy.cooldown_after(self._reopens)
        self._counts.clear()
        self._streak = 0
        return self._state

    def _close(self) -> BreakerState:
        self._state, self._probe_until, self._streak = BreakerState.closed, 0.0, 0
        self._counts.clear()
        return self._state


@lru_cache(maxsize=256)
def local_breaker(name: str, policy: BreakerPolicy) -> LocalBreaker:
    """The process's breaker for a deployment: it outlives the drain (and its client) that used it."""
    return LocalBreaker(name, policy)


# KEYS[1] = the deployment's hash; ARGV = cooldown_s, probe_ttl_s, key_ttl_ms.
# Returns {allowed, probe, retry_after_s as a string (Lua numbers come back truncated)}.
_ALLOW = """
local st = redis.call('HMGET', KEYS[1], 'state', 'opened_at', 'probe_until', 'cooldown')
local state = st[1] or 'closed'
if state == 'closed' then return {1, 0, '0'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local probe_until = tonumber(st[3] or '0')
if state == 'open' then
  local wait = tonumber(st[2]) + tonumber(st[4] or ARGV[1]) - now
  if wait > 0 then return {0, 0, tostring(wait)} end
  redis.call('HSET', KEYS[1], 'state', 'half_open')
  probe_until = 0
end
if now >= probe_until then
  redis.call('HSET', KEYS[1], 'probe_until', tostring(now + tonumber(ARGV[2])))
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, 1, '0'}
end
return {0, 0, tostring(probe_until - now)}
"""

# KEYS[1] = the deployment's hash; ARGV = ok, probe, window_s, buckets, min_failures,
# failure_ratio, key_ttl_ms, calls (successes reported together: ok only), cooldown_s,
# max_cooldown_s (a failed probe reopens it for twice as long as last time, up to this),
# streak_s, sent_s_ago (how long before this report the call was sent, by the reporter's clock:
# an age, so the hosts' clocks need not agree with Redis's). Fields c:<bucket> / f:<bucket>
# count calls / failures per step of the window; streak / streak_since / fresh the failures
# since the last success, when the first came back, and how many were sent after that.
# Returns the new state when this report changed it, else ''.
_RECORD = """
local key, ok, probe = KEYS[1], ARGV[1] == '1', ARGV[2] == '1'
local window, buckets = tonumber(ARGV[3]), tonumber(ARGV[4])
local min_failures, ratio, ttl_ms = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local calls_n = tonumber(ARGV[8] or '1')
local cooldown, max_cooldown = tonumber(ARGV[9] or '5'), tonumber(ARGV[10] or '0')
local streak_s = tonumber(ARGV[11] or '0')
local sent_ago = tonumber(ARGV[12] or '0')
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local state = redis.call('HGET', key, 'state') or 'closed'
local function open(again)
  local reopens = 0
  if again then reopens = tonumber(redis.call('HGET', key, 'reopens') or '0') + 1 end
  local wait = math.min(math.max(cooldown, max_cooldown), cooldown * 2 ^ reopens)
  redis.call('DEL', key)
  redis.call('HSET', key, 'state', 'open', 'opened_at', tostring(now), 'reopens', reopens, 'cooldown', tostring(wait))
  redis.call('PEXPIRE', key, ttl_ms)
  return 'open'
end
if state == 'half_open' then
  if not probe then return '' end
  if ok then
    redis.call('DEL', key)
    return 'closed'
  end
  return open(true)
end
if state == 'open' then return '' end
local b = math.floor(now / (window / buckets))
if redis.call('HINCRBY', key, 'c:' .. b, calls_n) == calls_n then
  for _, f in ipairs(redis.call('HKEYS', key)) do
    local idx = tonumber(string.match(f, '^[cf]:(%d+)$'))
    if idx and idx <= b - buckets then redis.call('HDEL', key, f) end
  end
end
redis.call('PEXPIRE', key, ttl_ms)
if ok then
  redis.call('HSET', key, 'streak', 0)
  return ''
end
redis.call('HINCRBY', key, 'f:' .. b, 1)
local streak = redis.call('HINCRBY', key, 'streak', 1)
local fresh = 0
if streak == 1 then
  redis.call('HSET', key, 'streak_since', tostring(now), 'fresh', 0)
end
local since = tonumber(redis.call('HGET', key, 'streak_since') or tostring(now))
if streak > 1 and now - sent_ago > since then
  fresh = redis.call('HINCRBY', key, 'fresh', 1)
else
  fresh = tonumber(redis.call('HGET', key, 'fresh') or '0')
end
local calls, failures = 0, 0
local all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  local kind, idx = string.match(all[i], '^([cf]):(%d+)$')
  if kind and tonumber(idx) > b - buckets then
    if kind == 'c' then calls = calls + tonumber(all[i + 1]) else failures = failures + tonumber(all[i + 1]) end
  end
end
local confirmed = streak >= min_failures and (fresh >= min_failures or now - since >= streak_s)
if failures >= min_failures and (failures >= ratio * calls or confirmed) then return open(false) end
return ''
"""

REDIS_RETRY_S = 5.0  # after a Redis error, use the local twin this long before trying Redis again


class SharedBreaker:
    """A deployment's breaker in Redis (a hash at `<namespace>:breaker:<name>`), shared by all
    workers. `redis` is a `redis.asyncio.Redis` client with decode_responses=True."""

    def __init__(self, redis: Any, name: str, policy: BreakerPolicy | None = None, *, namespace: str = "backfill"):
        self.name = name
        self.policy = policy or BreakerPolicy()
        self.key = f"{namespace}:breaker:{name}"
        self._redis = redis
        self._allow = redis.register_script(_ALLOW)
        self._record = redis.register_script(_RECORD)
        self._fallback = local_breaker(name, self.policy)
        self._redis_away_until = 0.0
        self._successes = 0  # successes not yet added to the shared window
        self._reporting: asyncio.Task[None] | None = None

    async def allow(self) -> Permit:
        p = self.policy
        if self._redis_up():
            try:
                allowed, probe, wait = await self._allow(
                    keys=[self.key], args=[p.cooldown_s, p.probe_ttl_s, p.key_ttl_ms]
                )
                return Permit(bool(int(allowed)), bool(int(probe)), float(wait))
            except (RedisError, OSError) as exc:  # Redis away: decide locally, never stop the drain
                self._redis_lost(exc)
        return self._fallback.allow_now()

    async def record(self, *, ok: bool, probe: bool = False, sent_s_ago: float = 0.0) -> BreakerState | None:
        if ok and not probe:
            # A success that is not the probe never changes the state (closed: it is counted;
            # half-open: only the probe speaks; open: a late answer), so successes go together:
            # one script call for all that came back while the last one was out.
            self._successes += 1
            if self._reporting is None or self._reporting.done():
                self._reporting = asyncio.create_task(self._report_successes())
            return None
        await self.flush()  # order matters: a success before this failure ends a streak
        p = self.policy
        if self._redis_up():
            try:
                changed = await self._record(
                    keys=[self.key],
                    args=[
                        int(ok),
                        int(probe),
                        *self._window_args(),
                        1,
                        p.cooldown_s,
                        p.max_cooldown_s,
                        p.streak_s,
                        sent_s_ago,
                    ],
                )
                return BreakerState(changed) if changed else None
            except (RedisError, OSError) as exc:
                self._redis_lost(exc)
        return self._fallback.record_now(ok=ok, probe=probe, sent_s_ago=sent_s_ago)

    async def state(self) -> BreakerState:
        return BreakerState(await self._redis.hget(self.key, "state") or BreakerState.closed)

    async def flush(self) -> None:
        if self._reporting is not None:
            await self._reporting

    async def _report_successes(self) -> None:
        p = self.policy
        while self._successes:
            n, self._successes = self._successes, 0
            if self._redis_up():
                try:
                    await self._record(
                        keys=[self.key],
                        args=[1, 0, *self._window_args(), n, p.cooldown_s, p.max_cooldown_s, p.streak_s],
                    )
                    continue
                except (RedisError, OSError) as exc:
                    self._redis_lost(exc)
            for _ in range(n):
                self._fallback.record_now(ok=True)

    def _window_args(self) -> list[float | int]:
        p = self.policy
        return [p.window_s, p.buckets, p.min_failures, p.failure_ratio, p.key_ttl_ms]

    def _redis_up(self) -> bool:
        return time.monotonic() >= self._redis_away_until

    def _redis_lost(self, exc: Exception) -> None:
        log.warning(
            "breaker %s: Redis unavailable (%r); deciding in this process for %.0f s", self.name, exc, REDIS_RETRY_S
        )
        self._redis_away_until = time.monotonic() + REDIS_RETRY_S
