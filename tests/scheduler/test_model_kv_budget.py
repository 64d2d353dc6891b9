"""The KV budget per model, on Redis: a drain's claims of a model's lines size prefix groups by
the budget its own controller publishes for its pool on a deployment serving several models,
else by its deployment's; a one-model fleet reads the deployments' budgets as it always did."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

from backfill.scheduler.capacity.admission import Admission, KvBudget, pool_of
from backfill.scheduler.capacity.controller import CapacityLoop
from backfill.scheduler.capacity.law import ControlConfig, Controller, Slo
from backfill.scheduler.capacity.telemetry import KvModel
from backfill.scheduler.drain.dispatcher import Dispatcher
from backfill.scheduler.fleet.client import FleetClient
from backfill.scheduler.fleet.routing import FleetRoutes, Pool
from backfill.storage.leases import RedisLeaseStore, kv_key
from backfill.storage.objects import LocalObjectStore
from tests.scheduler.test_capacity import snap

A, B = "model-a", "model-b"
BOTH, ONLY_A = "http://both.invalid/v1", "http://only-a.invalid/v1"
CFG = ControlConfig(slo=Slo(ttft_s=0.2, itl_s=0.02), floor=1, ceiling=64, kv=KvModel(bytes_per_token=576))


def budget_of(decoders: int) -> int:
    """snap(): 2048 blocks x 64 tokens per decoder, the batch share of it open to batch work."""
    return int(2048 * 64 * decoders * CFG.kv_batch_share)


class Decoders:
    """Telemetry of `n` decoders (a model's own workers)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def scrape(self) -> object:
        return snap(time.monotonic(), workers=self.n)

    def close(self) -> None:
        pass


def publish(leases: RedisLeaseStore, deployment: int | Pool, decoders: int) -> int:
    """One step of the controller of `deployment` (a deployment, or a model's pool on one)."""
    CapacityLoop(Controller(CFG), Decoders(decoders), leases, deployment=deployment).once()  # type: ignore[arg-type]
    published = leases.read(kv_key(pool_of(deployment)))
    assert published is not None
    return int(published)


def routes_for(served: dict[str, frozenset[str]]) -> FleetRoutes:
    routes = FleetRoutes(list(served), served.get)
    routes.refresh()
    return routes


def test_a_models_claims_read_its_own_pools_budget_else_its_deployments(redis_url: str) -> None:
    leases = RedisLeaseStore(redis_url, namespace=f"kvmodel-{secrets.token_hex(4)}")
    admission = Admission(leases, fixed_limit=8, ttl_s=60, controlled=True, deployments=2)
    routes = routes_for({BOTH: frozenset({A, B}), ONLY_A: frozenset({A})})
    a_own = publish(leases, Pool(0, A), decoders=1)  # A's workers on the two-model deployment
    only_a = publish(leases, 1, decoders=2)  # the one-model deployment's controller
    assert (a_own, only_a) == (budget_of(1), budget_of(2))

    a_pools = routes.pools(range(2), {A})
    assert a_pools == [Pool(0, A), Pool(1)]
    # A's: its own pool's on the first deployment, the deployment's on the second; held by A's lines.
    assert admission.kv_budget(a_pools, routes.models_of) == KvBudget(a_own + only_a, frozenset({A}))
    # B's controller published nothing and neither did the deployment: no budget, nothing sized.
    assert admission.kv_budget(routes.pools(range(2), {B}), routes.models_of) is None
    both = publish(leases, 0, decoders=4)  # a deployment-wide controller appears on the first
    assert admission.kv_budget(routes.pools(range(2), {B}), routes.models_of) == KvBudget(both, frozenset({A, B}))
    # What the drains read before per-model budgets, and still read without routes: the deployments'.
    assert admission.kv_budget_tokens() == both + only_a


def test_a_one_model_fleet_reads_the_deployments_budgets_as_before(redis_url: str) -> None:
    leases = RedisLeaseStore(redis_url, namespace=f"kvmodel-{secrets.token_hex(4)}")
    admission = Admission(leases, fixed_limit=8, ttl_s=60, controlled=True, deployments=2)
    routes = routes_for({BOTH: frozenset({A}), ONLY_A: frozenset({A})})
    total = publish(leases, 0, decoders=1) + publish(leases, 1, decoders=3)
    budget = admission.kv_budget(routes.pools(range(2), {A}), routes.models_of)
    assert budget == KvBudget(total, frozenset({A})) and admission.kv_budget_tokens() == total
    unknown = routes_for({BOTH: None, ONLY_A: None})  # type: ignore[dict-item]  # neither has answered /v1/models
    assert admission.kv_budget(unknown.pools(range(2), {A}), unknown.models_of) == KvBudget(total, None)
    assert Admission(leases, fixed_limit=8, ttl_s=60, deployments=2).kv_budget([Pool(0), Pool(1)]) is None


def test_the_drain_sizes_each_models_claims_by_that_models_budget(redis_url: str, tmp_path: Path) -> None:
    """The drain's claim groups (a pool's models) read their own budgets, once per drain."""
    leases = RedisLeaseStore(redis_url, namespace=f"kvmodel-{secrets.token_hex(4)}")
    admission = Admission(leases, fixed_limit=8, ttl_s=60, controlled=True, deployments=1)
    routes = routes_for({BOTH: frozenset({A, B})})
    a_own, b_own = publish(leases, Pool(0, A), decoders=1), publish(leases, Pool(0, B), decoders=3)

    async def go() -> Dispatcher:
        fleet = FleetClient([BOTH], timeout_s=5, routes=routes)
        await fleet.aclose()
        return Dispatcher(
            store=LocalObjectStore(tmp_path),
            leases=leases,
            admission=admission,
            fleet=fleet,
            planner=lambda n: [],
            max_attempts=3,
            kv_budget_tokens=admission.kv_budget_tokens(),
            kv_by_model=True,
            routes=routes,
        )

    drain = asyncio.run(go())
    assert drain.kv_budget_tokens is None  # no deployment-wide controller: before, nothing was sized
    assert drain._kv_budget(frozenset({A})) == KvBudget(a_own, frozenset({A}))
    assert drain._kv_budget(frozenset({B})) == KvBudget(b_own, frozenset({B}))
    leases.withdraw(kv_key(pool_of(Pool(0, A))))
    assert drain._kv_budget(frozenset({A})) == KvBudget(a_own, frozenset({A}))  # read once per drain
