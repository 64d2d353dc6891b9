"""The circuit breaker's state machine, in the process and on the real Redis (shared by workers)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio

from backfill.scheduler.fleet.breaker import Breaker, BreakerPolicy, BreakerState, LocalBreaker, Permit, SharedBreaker

# Short enough to run in a second, long enough that Redis round trips do not blur the steps.
POLICY = BreakerPolicy(
    window_s=2.0, buckets=4, min_failures=3, failure_ratio=0.5, streak_s=0.3, cooldown_s=0.4, probe_ttl_s=0.6
)


def redis_client(url: str) -> Any:
    return redis.asyncio.Redis.from_url(url, decode_responses=True)


@pytest.fixture(params=["local", "shared"])
def make_breaker(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Callable[[BreakerPolicy], Breaker]]:
    """Build one breaker of each kind on a fresh name; the shared one on its own Redis client."""

    def make(policy: BreakerPolicy = POLICY) -> Breaker:
        name = f"http://deployment-{uuid.uuid4().hex[:8]}/v1"
        if request.param == "local":
            return LocalBreaker(name, policy)
        return SharedBreaker(redis_client(redis_url), name, policy, namespace=f"test-{uuid.uuid4().hex[:8]}")

    yield make


async def fail(b: Breaker, n: int, *, sent_s_ago: float = 0.0) -> list[BreakerState | None]:
    return [await b.record(ok=False, sent_s_ago=sent_s_ago) for _ in range(n)]


async def succeed(b: Breaker, n: int) -> None:
    for _ in range(n):
        await b.record(ok=True)


def test_opens_on_min_failures_and_then_refuses(make_breaker: Callable[[BreakerPolicy], Breaker]) -> None:
    async def go() -> None:
        b = make_breaker(POLICY)
        assert await fail(b, 2) == [None, None]
        assert (await b.allow()).allowed and await b.state() is BreakerState.closed
        assert await fail(b, 1) == [BreakerState.open]
        permit = await b.allow()
        assert not permit.allowed and not permit.probe
        assert 0 < permit.retry_after_s <= POLICY.cooldown_s
        assert await b.record(ok=True) is None  # a late answer sent before the opening changes nothing
        assert await b.state() is BreakerState.open

    asyncio.run(go())


def test_a_mostly_good_window_stays_closed_but_a_streak_opens(make_breaker: Callable[[BreakerPolicy], Breaker]) -> None:
    async def go() -> None:
        b = make_breaker(POLICY)
        # 1 failure in 3 calls, over and over: failures reach the minimum but never half the calls.
        for _ in range(4):
            assert await b.record(ok=False) is None
            await succeed(b, 2)
        assert await b.state() is BreakerState.closed
        # The deployment dies: its window is still full of good answers, but nothing good comes
        # back any more, so min_failures in a row, lasting streak_s, open it.
        assert await fail(b, 3) == [None, None, None]
        await asyncio.sleep(POLICY.streak_s)
        assert await fail(b, 1) == [BreakerState.open]

    asyncio.run(go())


def test_one_engine_dying_fails_a_burst_but_the_deployment_stays_closed(
    make_breaker: Callable[[BreakerPolicy], Breaker],
) -> None:
    """One of two engines is killed: the requests it held fail together, in a row, while the other
    engine goes on answering. A streak that does not last is no evidence the deployment is down."""

    async def go() -> None:
        b = make_breaker(POLICY)
        await succeed(b, 12)
        # The dead engine's requests, all at once, each sent before the first of them failed.
        assert await fail(b, 6, sent_s_ago=1.0) == [None] * 6
        for _ in range(3):  # then its share of new calls fails fast, the live engine's succeed
            await asyncio.sleep(POLICY.streak_s / 3)
            await succeed(b, 1)
            assert await fail(b, 1) == [None]
        assert await b.state() is BreakerState.closed

    asyncio.run(go())


def test_a_streak_of_calls_sent_after_it_began_opens_without_waiting(
    make_breaker: Callable[[BreakerPolicy], Breaker],
) -> None:
    """A frontend that is down fails the requests it held (a burst, which alone is no evidence)
    and then every request sent after that, at once: those confirm the streak, so the drain is
    stopped before it pours its pending lines into the outage, however long streak_s is."""

    async def go() -> None:
        b = make_breaker(replace(POLICY, streak_s=60.0))
        await succeed(b, 12)
        assert await fail(b, 6, sent_s_ago=1.0) == [None] * 6
        assert await fail(b, POLICY.min_failures) == [None] * (POLICY.min_failures - 1) + [BreakerState.open]

    asyncio.run(go())


def test_intermittent_failures_open_on_the_ratio(make_breaker: Callable[[BreakerPolicy], Breaker]) -> None:
    async def go() -> None:
        b = make_breaker(POLICY)
        changes = []
        for _ in range(3):  # ok, fail, ok, fail ...: never 2 failures in a row, but half of all calls
            await succeed(b, 1)
            changes += await fail(b, 1)
        assert changes == [None, None, BreakerState.open]  # on the third: min_failures reached

    asyncio.run(go())


def test_failures_leave_the_window(make_breaker: Callable[[BreakerPolicy], Breaker]) -> None:
    async def go() -> None:
        policy = BreakerPolicy(window_s=0.8, buckets=4, min_failures=3, cooldown_s=0.4)
        b = make_breaker(policy)
        await fail(b, 2)
        await succeed(b, 1)  # breaks the streak: only the window could still open it
        await asyncio.sleep(policy.window_s + policy.window_s / policy.buckets)
        assert await fail(b, 2) == [None, None]  # 2 in the window, not 4
        assert await b.state() is BreakerState.closed

    asyncio.run(go())


def test_half_open_lets_one_probe_and_its_success_closes(make_breaker: Callable[[BreakerPolicy], Breaker]) -> None:
    async def go() -> None:
        b = make_breaker(POLICY)
        await fail(b, 3)
        await asyncio.sleep(POLICY.cooldown_s + 0.05)
        probe = await b.allow()
        assert probe.allowed and probe.probe
        assert await b.state() is BreakerState.half_open
        other = await b.allow()
        assert not other.allowed and 0 < other.retry_after_s <= POLICY.probe_ttl_s
        assert await b.record(ok=True) is None  # not the probe: a stray answer does not decide
        assert await b.record(ok=True, probe=True) is BreakerState.closed
        assert await b.allow() == Permit(True)
        assert await fail(b, 2) == [None, None]  # counting starts afresh after closing

    asyncio.run(go())


def test_a_failed_probe_opens_again_for_a_full_cooldown(make_breaker: Callable[[BreakerPolicy], Breaker]) -> None:
    async def go() -> None:
        b = make_breaker(POLICY)
        await fail(b, 3)
        await asyncio.sleep(POLICY.cooldown_s + 0.05)
        assert (await b.allow()).probe
        assert await b.record(ok=False, probe=True) is BreakerState.open
        permit = await b.allow()
        assert not permit.allowed and permit.retry_after_s > POLICY.cooldown_s - 0.1

    asyncio.run(go())


def test_each_failed_probe_doubles_the_cooldown_up_to_its_cap(
    make_breaker: Callable[[BreakerPolicy], Breaker],
) -> None:
    """A deployment that keeps refusing (an overflow provider out of quota, or refusing its key)
    is asked less and less often: each failed probe doubles the cool-down, up to the cap; a
    successful probe closes it, and the next opening starts from the plain cool-down again."""
    policy = replace(POLICY, max_cooldown_s=4 * POLICY.cooldown_s)

    async def reopen(b: Breaker) -> float:
        while not (permit := await b.allow()).allowed:
            await asyncio.sleep(max(0.01, permit.retry_after_s))
        assert permit.probe
        assert await b.record(ok=False, probe=True) is BreakerState.open
        return (await b.allow()).retry_after_s

    async def go() -> None:
        b = make_breaker(policy)
        await fail(b, 3)
        waits = [await reopen(b) for _ in range(3)]
        c = POLICY.cooldown_s
        assert 1.6 * c < waits[0] <= 2 * c and 3.2 * c < waits[1] <= 4 * c and 3.2 * c < waits[2] <= 4 * c, waits
        while not (permit := await b.allow()).allowed:
            await asyncio.sleep(max(0.01, permit.retry_after_s))
        assert await b.record(ok=True, probe=True) is BreakerState.closed
        await fail(b, 3)
        assert 0 < (await b.allow()).retry_after_s <= c

    asyncio.run(go())


def test_a_probe_that_never_reports_frees_its_slot(make_breaker: Callable[[BreakerPolicy], Breaker]) -> None:
    async def go() -> None:
        b = make_breaker(POLICY)
        await fail(b, 3)
        await asyncio.sleep(POLICY.cooldown_s + 0.05)
        assert (await b.allow()).probe  # ... and its worker dies
        assert not (await b.allow()).allowed
        await asyncio.sleep(POLICY.probe_ttl_s + 0.05)
        assert (await b.allow()).probe

    asyncio.run(go())


def test_two_workers_share_one_breaker(redis_url: str) -> None:
    """Two breakers on separate Redis connections (two workers): one's evidence opens it for
    the other, only one of them gets the probe, and the probe's success closes it for both."""

    async def go() -> None:
        name, ns = "http://fleet-a.example/v1", f"test-{uuid.uuid4().hex[:8]}"
        w1 = SharedBreaker(redis_client(redis_url), name, POLICY, namespace=ns)
        w2 = SharedBreaker(redis_client(redis_url), name, POLICY, namespace=ns)
        other = SharedBreaker(redis_client(redis_url), "http://fleet-b.example/v1", POLICY, namespace=ns)
        await w1.record(ok=False)
        await w2.record(ok=False)  # failures add up across workers
        assert await w1.record(ok=False) is BreakerState.open
        assert not (await w2.allow()).allowed
        assert (await other.allow()).allowed  # per deployment
        await asyncio.sleep(POLICY.cooldown_s + 0.05)
        permits = await asyncio.gather(w1.allow(), w2.allow())
        assert sorted(p.probe for p in permits) == [False, True]
        prober = w1 if permits[0].probe else w2
        assert await prober.record(ok=True, probe=True) is BreakerState.closed
        assert (await w1.allow()).allowed and (await w2.allow()).allowed
        assert await w2.state() is BreakerState.closed

    asyncio.run(go())


def test_the_window_is_pruned_in_redis(redis_url: str) -> None:
    """Steady traffic over many window steps keeps the hash small (old steps are deleted)."""

    async def go() -> None:
        policy = BreakerPolicy(window_s=0.4, buckets=4, min_failures=3, cooldown_s=0.4)
        r = redis_client(redis_url)
        b = SharedBreaker(r, "http://steady.example/v1", policy, namespace=f"test-{uuid.uuid4().hex[:8]}")
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            await b.record(ok=True)
            await asyncio.sleep(0.02)
        fields = await r.hkeys(b.key)
        assert 1 <= len([f for f in fields if f.startswith("c:")]) <= policy.buckets + 1, fields
        assert await r.pttl(b.key) > 0  # an idle breaker does not stay in Redis forever

    asyncio.run(go())


def test_redis_away_falls_back_to_the_process(redis_url: str) -> None:
    """With Redis unreachable the breaker still decides (in this process) instead of failing."""

    async def go() -> None:
        dead = redis.asyncio.Redis.from_url("redis://127.0.0.1:9/0", socket_connect_timeout=0.5)
        b = SharedBreaker(dead, f"http://lonely-{uuid.uuid4().hex[:6]}/v1", POLICY)
        assert (await b.allow()).allowed
        assert await fail(b, 3) == [None, None, BreakerState.open]
        assert not (await b.allow()).allowed

    asyncio.run(go())
