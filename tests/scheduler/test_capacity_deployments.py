"""Capacity per deployment: each deployment's controller steers on its own telemetry and
publishes its own limit, and leases are taken per deployment, so a busy datacenter's small
limit never throttles an idle one (fake telemetry here; the real fleets are in tests/e2e)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable

from backfill.scheduler.capacity.admission import Admission, pool_of
from backfill.scheduler.capacity.controller import CapacityLoop, FleetCapacityLoop
from backfill.scheduler.capacity.law import ControlConfig, Controller, Slo
from backfill.scheduler.capacity.telemetry import FleetSnapshot
from backfill.scheduler.fleet.routing import Pool
from backfill.storage.leases import RedisLeaseStore, limit_key, shed_key
from tests.scheduler.test_capacity import snap

SLO = Slo(ttft_s=0.2, itl_s=0.020)


class FakeTelemetry:
    """A deployment's telemetry: its latency, and its in-flight count from the leases held there."""

    def __init__(self, itl: float, inflight: Callable[[], int]) -> None:
        self.itl = itl
        self.inflight = inflight
        self.closed = False

    def scrape(self) -> FleetSnapshot:
        return snap(time.monotonic(), itl=self.itl, inflight=self.inflight())

    def close(self) -> None:
        self.closed = True


def test_a_busy_deployment_does_not_throttle_an_idle_one(redis_url: str) -> None:
    leases = RedisLeaseStore(redis_url, namespace=f"capdep-{secrets.token_hex(4)}")
    cfg = ControlConfig(slo=SLO, floor=1, ceiling=48, period_s=0.25)
    busy = FakeTelemetry(0.012, lambda: leases.count(pool_of(0)))  # interactive traffic heavy at A
    idle = FakeTelemetry(0.008, lambda: leases.count(pool_of(1)))
    fleet = FleetCapacityLoop(
        [
            CapacityLoop(Controller(cfg), busy, leases, deployment=0),  # type: ignore[arg-type]
            CapacityLoop(Controller(cfg), idle, leases, deployment=1),  # type: ignore[arg-type]
        ]
    )
    admission = Admission(leases, fixed_limit=999, ttl_s=60, controlled=True, floor=1, deployments=2)
    held: dict[int, list[str]] = {0: [], 1: []}
    for step in range(60):
        if step == 20:
            busy.itl = 0.040  # A's interactive latency goes past its SLO (B's stays low)
        fleet.once()
        for d in (0, 1):
            target = admission.shed_target(d)
            if target is not None and len(held[d]) > target:  # drains shed down to the target
                gone, held[d] = held[d][target:], held[d][:target]
                leases.release(pool_of(d), gone)
        before = {d: leases.count(pool_of(d)) for d in (0, 1)}
        for lease, pool in asyncio.run(admission.acquire_spread(200, wait_s=0.0)):
            held[pool.deployment].append(lease)
        for d in (0, 1):
            # Each deployment's in-flight stays within its own limit (or what it held before a cut).
            assert leases.count(pool_of(d)) <= max(admission.limit(d), before[d]), (step, d)
    a, b = admission.limit(0), admission.limit(1)
    assert a <= 2, f"A's limit should have fallen to the floor, is {a}"
    assert b >= 30, f"B's limit should have grown while A was cut, is {b}"
    assert len(held[0]) <= 2 and len(held[1]) == b
    assert leases.read(limit_key(pool_of(0))) == str(a) and leases.read(limit_key(pool_of(1))) == str(b)
    assert leases.read(shed_key(pool_of(1))) is None  # B was never asked to shed
    fleet.withdraw()
    assert leases.read(limit_key(pool_of(0))) is None and leases.read(limit_key(pool_of(1))) is None
    assert admission.limit(1) == 1  # fail closed on each deployment


def test_leases_spread_over_deployments_and_skip_an_open_circuit(redis_url: str) -> None:
    leases = RedisLeaseStore(redis_url, namespace=f"capdep-{secrets.token_hex(4)}")
    admission = Admission(leases, fixed_limit=10, ttl_s=60, deployments=3)

    async def go() -> None:
        got = await admission.acquire_spread(12, wait_s=0.0)
        assert sorted(p.deployment for _, p in got) == [0] * 4 + [1] * 4 + [2] * 4  # an even share each

        async def a_open(n: int) -> dict[Pool, int]:
            return {Pool(0): 0, Pool(1): n, Pool(2): n}

        more = await admission.acquire_spread(40, wait_s=0.0, room=a_open)
        assert {p.deployment for _, p in more} == {1, 2} and len(more) == 12  # each up to its own limit of 10
        assert [leases.count(pool_of(d)) for d in range(3)] == [4, 10, 10]

    asyncio.run(go())
