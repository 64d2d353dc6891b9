"""Fair share across teams holds within each model, on Postgres: a drain's claims for one model's
pool split it between that model's teams by weight while another model's batch fills its own
pool, even when one of the teams also runs that other model's batch (its work there charges it
nothing on this model)."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from backfill.scheduler.capacity.admission import Admission
from backfill.scheduler.drain.dispatcher import Dispatcher
from backfill.scheduler.drain.escalation import Escalator
from backfill.scheduler.fleet.client import FleetClient
from backfill.scheduler.fleet.routing import FleetRoutes, Pool
from backfill.scheduler.runtime import Planner
from backfill.storage.db import unit_of_work
from backfill.storage.leases import RedisLeaseStore
from backfill.storage.objects import LocalObjectStore
from tests.factories import make_batch, make_team
from tests.process_env import scratch_database

A, B = "model-a", "model-b"
FLEET = "http://fleet.invalid/v1"
PER_POOL, ROUNDS = 8, 12  # leases a round gives each model's pool; rounds


@pytest.fixture(scope="module")
def scratch_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    unset: dict[str, str | None] = {"BACKFILL_S3_ENDPOINT_URL": None}
    with scratch_database("backfill_fairmodel", tmp_path_factory.mktemp("fairmodel-home"), **unset) as url:
        yield url


def test_a_models_pool_is_shared_by_its_teams_weights_while_another_model_runs(
    scratch_db: str, redis_url: str, tmp_path: Path
) -> None:
    with unit_of_work() as s:
        light, heavy = make_team(s), make_team(s)
        heavy.weight = 3
        a_light = make_batch(s, light, lines=400, model=A).id
        a_heavy = make_batch(s, heavy, lines=400, model=A).id
        b_light = make_batch(s, light, lines=400, model=B).id  # the light team's batch on the other model
    team_of = {a_light: "light", a_heavy: "heavy", b_light: "light"}
    routes = FleetRoutes([FLEET], {FLEET: frozenset({A, B})}.get)
    routes.refresh()
    leases = RedisLeaseStore(redis_url, namespace=f"fairmodel-{secrets.token_hex(4)}")
    admission = Admission(leases, fixed_limit=PER_POOL, ttl_s=60)

    async def make() -> Dispatcher:
        fleet = FleetClient([FLEET], timeout_s=5, routes=routes)
        await fleet.aclose()
        return Dispatcher(
            store=LocalObjectStore(tmp_path),
            leases=leases,
            admission=admission,
            fleet=fleet,
            planner=Planner(admission, refresh_s=0.0, escalator=Escalator()),
            max_attempts=3,
            routes=routes,
        )

    drain = asyncio.run(make())
    on_a: Counter[str] = Counter()
    on_b = 0
    for r in range(ROUNDS):
        # A round's leases: each model's pool full (the claims are what is under test, not admission).
        pools = [Pool(0, A)] * PER_POOL + [Pool(0, B)] * PER_POOL
        claimed, used, spare = drain._claim([(f"lease-{r}-{i}", p) for i, p in enumerate(pools)])
        assert spare == []
        for request, (_, pool) in zip(claimed, used, strict=True):
            if pool == Pool(0, A):
                assert request.batch_id in (a_light, a_heavy)
                on_a[team_of[request.batch_id]] += 1
            else:
                assert request.batch_id == b_light
                on_b += 1
    assert on_b == ROUNDS * PER_POOL  # B's batch has its pool to itself, every round
    assert sum(on_a.values()) == ROUNDS * PER_POOL
    # By weight, 1:3, within a line of each round's split; the light team's lines of B charge it nothing here.
    assert abs(on_a["heavy"] - 3 * on_a["light"]) <= 4, on_a
