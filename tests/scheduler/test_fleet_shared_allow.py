"""The fleet client asks a shared breaker once for the lines a claim launches together.

A claim starts its lines at once; each used to ask Redis whether the deployment's circuit was
closed, in the same millisecond. Concurrent askers now share a question in flight when its
answer is a plain pass, and only then: a probe stays one caller's, a refusal is asked again.
"""

from __future__ import annotations

import asyncio
import time

from backfill.scheduler.fleet.breaker import BreakerPolicy, BreakerState, Permit, SharedBreaker
from backfill.scheduler.fleet.client import FleetClient


class _CountingBreaker:
    """A breaker whose answer takes a moment (a Redis round trip), counting the questions."""

    def __init__(self, answers: list[Permit]) -> None:
        self.name = "counting"
        self.asked = 0
        self._answers = answers

    async def allow(self) -> Permit:
        self.asked += 1
        answer = self._answers[min(self.asked, len(self._answers)) - 1]
        await asyncio.sleep(0.05)
        return answer

    async def record(self, *, ok: bool, probe: bool = False) -> BreakerState | None:
        return None

    async def state(self) -> BreakerState:
        return BreakerState.closed

    async def flush(self) -> None:
        return None


def _client(redis_url: str) -> FleetClient:
    return FleetClient(["http://127.0.0.1:9/v1"], timeout_s=5.0, redis_url=redis_url)


def test_concurrent_picks_share_one_question_when_the_circuit_is_closed(redis_url: str) -> None:
    async def run() -> tuple[int, list[bool]]:
        client = _client(redis_url)
        breaker = _CountingBreaker([Permit(True)])
        client.breakers[0] = breaker
        picks = await asyncio.gather(*(client._pick(skip=set()) for _ in range(20)))
        return breaker.asked, [p is not None and p[1].allowed for p, _ in picks]

    asked, allowed = asyncio.run(run())
    assert allowed == [True] * 20
    assert asked == 1  # before: 20, one per line


def test_a_probe_is_not_shared_and_the_others_ask_again(redis_url: str) -> None:
    async def run() -> tuple[int, list[tuple[bool, bool]]]:
        client = _client(redis_url)
        breaker = _CountingBreaker([Permit(True, probe=True), Permit(False, retry_after_s=1.0)])
        client.breakers[0] = breaker
        picks = await asyncio.gather(*(client._allow(0) for _ in range(5)))
        return breaker.asked, [(p.allowed, p.probe) for p in picks]

    asked, permits = asyncio.run(run())
    assert permits.count((True, True)) == 1  # one probe only
    assert permits.count((False, False)) == 4
    assert asked >= 2


def test_a_shed_asker_does_not_cancel_the_question_for_the_others(redis_url: str) -> None:
    async def run() -> list[bool]:
        client = _client(redis_url)
        client.breakers[0] = _CountingBreaker([Permit(True)])
        first = asyncio.create_task(client._allow(0))
        await asyncio.sleep(0)
        others = [asyncio.create_task(client._allow(0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        first.cancel()
        return [p.allowed for p in await asyncio.gather(*others)]

    assert asyncio.run(run()) == [True, True, True]


def test_a_half_open_shared_breaker_lets_one_probe_through_concurrent_picks(redis_url: str) -> None:
    """On the real Redis breaker: opened, cooled down, then 10 concurrent picks: one probe."""

    async def run() -> list[tuple[bool, bool]]:
        client = _client(redis_url)
        url = "http://127.0.0.1:9/v1"
        policy = BreakerPolicy(cooldown_s=0.1)
        breaker = SharedBreaker(client._redis, url, policy, namespace=f"test-shared-allow-{time.monotonic_ns()}")
        client.breakers[0] = breaker
        await client._redis.hset(breaker.key, mapping={"state": "open", "opened_at": "0"})  # type: ignore[union-attr]
        try:
            permits = await asyncio.gather(*(client._allow(0) for _ in range(10)))
        finally:
            await client._redis.delete(breaker.key)  # type: ignore[union-attr]
        return [(p.allowed, p.probe) for p in permits]

    permits = asyncio.run(run())
    assert permits.count((True, True)) == 1
    assert all(not allowed for allowed, probe in permits if not probe)
