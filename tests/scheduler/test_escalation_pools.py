"""Escalation per model, on Postgres and Redis: an escalated batch's relaxed extra is taken in its
model's own pool on a deployment serving several models (over that pool's limit, not in the
deployment's plain pool), and an overflow deployment gets only the lines of the models its
`/v1/models` lists (here the configured map, which stands for it)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import select

from backfill.jobs.models import BatchRequest, RequestState, utcnow
from backfill.scheduler.capacity.admission import Admission, pool_of
from backfill.scheduler.drain.escalation import (
    OVERFLOW_PREFIX,
    EscalatedRelease,
    Escalation,
    EscalationLimits,
    Step,
    escalated_plan,
)
from backfill.scheduler.fleet.breaker import BreakerState
from backfill.scheduler.fleet.routing import FleetRoutes, Pool
from backfill.storage.db import unit_of_work
from backfill.storage.fleet_models import ModelCatalog
from backfill.storage.leases import RedisLeaseStore
from tests.factories import make_batch, make_team
from tests.process_env import scratch_database

A, B = "model-a", "model-b"
FLEET = "http://fleet.invalid/v1"  # serves both models: a pool per model
LIMIT, EXTRA = 2, 1  # each pool's fixed limit; the escalation's relaxed extra


@pytest.fixture(scope="module")
def scratch_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    unset: dict[str, str | None] = {"BACKFILL_S3_ENDPOINT_URL": None}
    with scratch_database("backfill_escpools", tmp_path_factory.mktemp("escpools-home"), **unset) as url:
        yield url


def routes_for(served: dict[str, list[str]]) -> FleetRoutes:
    """What each deployment serves, from the catalog's configured map (no deployment is asked)."""
    catalog = ModelCatalog(list(served), ttl_s=30, configured=served)
    routes = FleetRoutes(list(served), catalog.served_by)
    routes.refresh()
    return routes


def batches_of(models: list[str], lines: int = 20) -> dict[str, str]:
    """A batch per model, each of its own team: batch id -> model."""
    out = {}
    with unit_of_work() as s:
        for model in models:
            out[make_batch(s, make_team(s), lines=lines, model=model).id] = model
    return out


def decided(models_of: dict[str, str], *, overflow_lines: int = 0) -> dict[str, Escalation]:
    return {
        b: Escalation(
            batch_id=b,
            step=Step.overflow if overflow_lines else Step.relaxed,
            min_rate=1.0,
            overflow_lines=overflow_lines,
            expires_at=utcnow() + timedelta(hours=1),
        )
        for b in models_of
    }


def release(
    leases: RedisLeaseStore,
    escalations: dict[str, Escalation],
    models_of: dict[str, str],
    *,
    extra: int,
    overflow: list[int],
) -> EscalatedRelease:
    return EscalatedRelease(
        admission=Admission(leases, fixed_limit=LIMIT, ttl_s=60, deployments=1),
        leases=leases,
        limits=EscalationLimits(relaxed_extra=extra, overflow_limit=32, overflow_deployments=overflow),
        escalated=lambda: escalations,
        relaxed_plan=lambda n: escalated_plan(escalations, n, overflow=False),
        overflow_plan=lambda n: escalated_plan(escalations, n, overflow=True),
        model_of=models_of.get,
    )


def test_the_relaxed_extra_is_taken_in_the_escalated_models_own_pool(scratch_db: str, redis_url: str) -> None:
    """A's pool is at its limit with ordinary lines; B's is empty. Escalated, A's batch gets the
    extra over A's pool's limit, B's batch gets B's pool's limit plus the extra, and nothing is
    taken in the deployment's plain pool (which no ordinary line of either model uses)."""
    leases = RedisLeaseStore(redis_url, namespace=f"escpools-{secrets.token_hex(4)}")
    routes = routes_for({FLEET: [A, B]})
    models_of = batches_of([A, B])
    escalations = decided(models_of)
    assert len(leases.acquire(pool_of(0, A), limit=LIMIT, n=LIMIT, ttl_s=60)) == LIMIT  # A's ordinary lines
    drain = release(leases, escalations, models_of, extra=EXTRA, overflow=[])

    taken = asyncio.run(drain.take(16, holder="drain-esc", states=[BreakerState.closed], held={}, routes=routes))

    by_pool: dict[Pool, list[str]] = {}
    for request, _, pool in taken:
        by_pool.setdefault(pool, []).append(models_of[request.batch_id])
    assert by_pool == {Pool(0, A): [A] * EXTRA, Pool(0, B): [B] * (LIMIT + EXTRA)}
    assert leases.count(pool_of(0, A)) == LIMIT + EXTRA
    assert leases.count(pool_of(0, B)) == LIMIT + EXTRA
    assert leases.count(pool_of(0)) == 0


def test_an_open_circuit_of_one_model_keeps_only_that_models_extra_off(scratch_db: str, redis_url: str) -> None:
    """A's pool has a circuit of its own: open (and a line of A already there) A's escalated
    lines take no extra, while B's still do."""
    leases = RedisLeaseStore(redis_url, namespace=f"escpools-{secrets.token_hex(4)}")
    routes = routes_for({FLEET: [A, B]})
    models_of = batches_of([A, B])
    drain = release(leases, decided(models_of), models_of, extra=EXTRA, overflow=[])

    async def circuits(pools: list[Pool]) -> dict[Pool, BreakerState]:
        return {p: BreakerState.open if p.model == A else BreakerState.closed for p in pools}

    taken = asyncio.run(
        drain.take(
            16,
            holder="drain-esc",
            states=[BreakerState.closed],
            held={Pool(0, A): 1},
            routes=routes,
            circuits=circuits,
        )
    )
    assert {pool for _, _, pool in taken} == {Pool(0, B)}
    assert len(taken) == LIMIT + EXTRA


def on_overflow(batch_id: str) -> int:
    with unit_of_work() as s:
        return len(
            s.execute(
                select(BatchRequest.line).where(
                    BatchRequest.batch_id == batch_id,
                    BatchRequest.state == RequestState.running,
                    BatchRequest.request_id == OVERFLOW_PREFIX,
                )
            ).all()
        )


def test_an_overflow_gets_only_the_lines_of_the_models_it_lists(scratch_db: str, redis_url: str) -> None:
    """Two overflow deployments, one listing only A, the other only B: each batch's overflow
    lines go to the one serving its model, never to the other, however much room it has."""
    leases = RedisLeaseStore(redis_url, namespace=f"escpools-{secrets.token_hex(4)}")
    only_a, only_b = "http://overflow-a.invalid/v1", "http://overflow-b.invalid/v1"
    routes = routes_for({FLEET: [A, B], only_a: [A], only_b: [B]})
    models_of = batches_of([A, B])
    share = 5
    drain = release(leases, decided(models_of, overflow_lines=share), models_of, extra=0, overflow=[1, 2])

    taken = asyncio.run(drain.take(32, holder="drain-ovf", states=[BreakerState.closed] * 3, held={}, routes=routes))

    where = {(models_of[request.batch_id], pool) for request, _, pool in taken}
    assert where == {(A, Pool(1)), (B, Pool(2))}
    assert len(taken) == 2 * share
    assert [on_overflow(b) for b in models_of] == [share, share]
    assert leases.count(pool_of(1)) == share and leases.count(pool_of(2)) == share


def test_an_overflow_listing_no_model_of_the_batch_gets_none_of_its_lines(scratch_db: str, redis_url: str) -> None:
    leases = RedisLeaseStore(redis_url, namespace=f"escpools-{secrets.token_hex(4)}")
    only_a = "http://overflow-a.invalid/v1"
    routes = routes_for({FLEET: [A, B], only_a: [A]})
    models_of = batches_of([B])
    drain = release(leases, decided(models_of, overflow_lines=5), models_of, extra=0, overflow=[1])

    taken = asyncio.run(drain.take(32, holder="drain-ovf", states=[BreakerState.closed] * 2, held={}, routes=routes))

    assert taken == []
    assert leases.count(pool_of(1)) == 0
    assert [on_overflow(b) for b in models_of] == [0]
