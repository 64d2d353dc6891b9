"""Many models, each with its own capacity: what each deployment serves, a lease pool per
(deployment, model), a controller per model's pool (fake telemetry here; the real fleets are in
tests/e2e/test_models.py)."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from backfill.scheduler.capacity.admission import Admission, pool_of
from backfill.scheduler.capacity.controller import CapacityLoop, FleetCapacityLoop
from backfill.scheduler.capacity.law import ControlConfig, Controller
from backfill.scheduler.capacity.telemetry import only_model
from backfill.scheduler.fleet.routing import FleetRoutes, Pool
from backfill.scheduler.runtime import make_capacity_loop
from backfill.storage.fleet_models import ModelCatalog
from backfill.storage.leases import RedisLeaseStore, limit_key
from backfill.storage.settings import MetricsEndpoint, Settings, parse_fleet_models, parse_metrics_endpoints
from tests.scheduler.test_capacity_deployments import SLO, FakeTelemetry

A, B = "model-a", "model-b"
UNREACHABLE = "http://127.0.0.1:9/v1"  # the discard port: nothing listens


def test_the_fleet_models_setting() -> None:
    assert parse_fleet_models(f"http://x/v1/={A}|{B}; http://y/v1={A}") == {"http://x/v1": [A, B], "http://y/v1": [A]}
    assert parse_fleet_models("") == {}
    with pytest.raises(ValueError, match="url=model"):
        parse_fleet_models("http://x/v1")
    assert Settings(fleet_models=f"http://x/v1={A}").fleet_models == {"http://x/v1": [A]}


def test_the_catalog_is_per_deployment_and_the_map_overrides() -> None:
    catalog = ModelCatalog([UNREACHABLE, "http://x/v1"], ttl_s=30, configured={"http://x/v1/": [A, B]})
    assert catalog.served_by("http://x/v1") == frozenset({A, B})  # never asked
    assert catalog.served_by(UNREACHABLE) is None  # never answered: unknown
    assert catalog.model_ids() == {A, B}


def test_routes_give_a_pool_per_model_only_where_a_deployment_serves_several() -> None:
    served = {"x": frozenset({A, B}), "y": frozenset({A}), "z": None}
    routes = FleetRoutes(["x", "y", "z"], served.get)
    routes.refresh()
    assert routes.serves(0, B) and not routes.serves(1, B) and routes.serves(2, B)  # z unknown: serves all
    assert routes.pools(range(3), {A, B}) == [Pool(0, A), Pool(0, B), Pool(1), Pool(2)]
    assert routes.pools(range(3), {B}) == [Pool(0, B), Pool(2)]  # y never gets a lease for B
    assert routes.claimable(Pool(0, B)) == {B} and routes.claimable(Pool(1)) == {A}
    assert routes.claimable(Pool(2)) is None
    assert [pool_of(p) for p in (Pool(0), Pool(0, B), Pool(1), Pool(1, A))] == [
        "fleet",
        f"fleet/{B}",
        "fleet:1",
        f"fleet:1/{A}",
    ]


def test_a_full_model_pool_leaves_the_other_models_pool_its_whole_limit(redis_url: str) -> None:
    """Work conservation at admission: A's pool at its limit takes nothing, and B's share of the
    round goes to B up to B's own limit (not split with A, not held behind it)."""
    leases = RedisLeaseStore(redis_url, namespace=f"models-{secrets.token_hex(4)}")
    admission = Admission(leases, fixed_limit=4, ttl_s=60)

    async def room(n: int) -> dict[Pool, int]:
        return {Pool(0, A): n, Pool(0, B): n}

    async def go() -> None:
        held_a = leases.acquire(pool_of(0, A), limit=4, n=4, ttl_s=60)  # A's pool is full
        assert len(held_a) == 4
        got = await admission.acquire_spread(8, wait_s=0.0, room=room)
        assert [p for _, p in got] == [Pool(0, B)] * 4  # B's full fixed limit
        assert leases.count(pool_of(0, A)) == 4 and leases.count(pool_of(0, B)) == 4

    asyncio.run(go())


def test_a_controller_per_model_cuts_only_the_busy_models_limit(redis_url: str) -> None:
    leases = RedisLeaseStore(redis_url, namespace=f"models-{secrets.token_hex(4)}")
    cfg = ControlConfig(slo=SLO, floor=1, ceiling=32, period_s=0.25)
    busy = FakeTelemetry(0.012, lambda: leases.count(pool_of(0, A)))
    idle = FakeTelemetry(0.008, lambda: leases.count(pool_of(0, B)))
    fleet = FleetCapacityLoop(
        [
            CapacityLoop(Controller(cfg), busy, leases, deployment=Pool(0, A)),  # type: ignore[arg-type]
            CapacityLoop(Controller(cfg), idle, leases, deployment=Pool(0, B)),  # type: ignore[arg-type]
        ]
    )
    admission = Admission(leases, fixed_limit=999, ttl_s=60, controlled=True, floor=1)

    async def room(n: int) -> dict[Pool, int]:
        return {Pool(0, A): n, Pool(0, B): n}

    held: dict[Pool, list[str]] = {Pool(0, A): [], Pool(0, B): []}
    for step in range(60):
        if step == 20:
            busy.itl = 0.040  # model A's interactive latency goes past its SLO; B's workers are idle
        fleet.once()
        for pool, ids in held.items():  # each step's lines finish; the next take what the limits allow
            leases.release(pool_of(pool), ids)
            ids.clear()
        for lease, pool in asyncio.run(admission.acquire_spread(100, wait_s=0.0, room=room)):
            held[pool].append(lease)
    a, b = admission.limit(Pool(0, A)), admission.limit(Pool(0, B))
    assert a <= 2, f"A's limit should have fallen to the floor, is {a}"
    assert b >= 30, f"B's limit should have grown to its ceiling while A was cut, is {b}"
    assert leases.read(limit_key(pool_of(Pool(0, B)))) == str(b)
    assert leases.read(limit_key(pool_of(0))) is None  # the deployment itself has no controller of its own
    fleet.withdraw()


def test_per_model_metrics_endpoints_make_a_controller_per_model_pool(redis_url: str) -> None:
    spec = f"frontend=http://f/metrics,agg@{A}=http://a/metrics,agg@{B}=http://b/metrics;http://g/metrics"
    deployments = parse_metrics_endpoints(spec)
    assert deployments[0][1] == MetricsEndpoint("agg", "http://a/metrics", A)
    s = Settings(fleet_urls="http://f/v1,http://g/v1", fleet_metrics_urls=spec, capacity_control="on")
    loop = make_capacity_loop(s, RedisLeaseStore(redis_url, namespace=f"models-{secrets.token_hex(4)}"))
    assert isinstance(loop, FleetCapacityLoop)
    assert [lp.deployment for lp in loop.loops] == [Pool(0, A), Pool(0, B), 1]
    assert [[e.url for e in lp.telemetry.endpoints] for lp in loop.loops] == [
        ["http://f/metrics", "http://a/metrics"],
        ["http://f/metrics", "http://b/metrics"],
        ["http://g/metrics"],
    ]
    assert loop.loops[1].telemetry.model == B


def test_a_models_frontend_series_leave_the_others_out() -> None:
    text = "\n".join(
        [
            f'dynamo_frontend_inflight_requests{{model="{A}"}} 7',
            f'dynamo_frontend_inflight_requests{{model="{B}"}} 1',
            "process_cpu_seconds_total 3",
        ]
    )
    assert only_model(text, B).splitlines() == [
        f'dynamo_frontend_inflight_requests{{model="{B}"}} 1',
        "process_cpu_seconds_total 3",
    ]


def test_a_failing_model_opens_its_own_circuit_only() -> None:
    """On a deployment serving two models each has a breaker: A's workers failing open A's
    circuit, and B's lines still pass (the deployment's own breaker, for one-model deployments,
    is untouched)."""
    from backfill.scheduler.fleet.breaker import BreakerPolicy, BreakerState
    from backfill.scheduler.fleet.client import FleetClient

    x, y = f"http://127.0.0.1:9/{secrets.token_hex(4)}/v1", f"http://127.0.0.1:9/{secrets.token_hex(4)}/v1"
    routes = FleetRoutes([x, y], {x: frozenset({A, B}), y: frozenset({A})}.get)
    routes.refresh()

    async def go() -> None:
        fleet = FleetClient([x, y], timeout_s=5, routes=routes, breaker_policy=BreakerPolicy(min_failures=3))
        try:
            assert fleet.breaker(0, A) is not fleet.breaker(0, B) and fleet.breaker(1, A) is fleet.breakers[1]
            for _ in range(5):
                await fleet.breaker(0, A).record(ok=False)
            states = await fleet.pool_states([Pool(0, A), Pool(0, B), Pool(1)])
            assert states == {
                Pool(0, A): BreakerState.open,
                Pool(0, B): BreakerState.closed,
                Pool(1): BreakerState.closed,
            }
            assert not (await fleet._allow(0, A)).allowed and (await fleet._allow(0, B)).allowed
            assert await fleet.states() == [BreakerState.closed, BreakerState.closed]
        finally:
            await fleet.aclose()

    asyncio.run(go())
