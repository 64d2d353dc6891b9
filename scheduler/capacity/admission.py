"""The one admission point: every fleet request holds a capacity lease while in flight.

Each fleet deployment (`BACKFILL_FLEET_URLS` may name several, e.g. one per datacenter) has a
lease pool, a limit and a shed target of its own, and a lease is for one deployment: the request
holding it goes there and nowhere else, so what is in flight at a deployment never exceeds its
own limit, and a busy deployment's small limit never holds back an idle one. Deployment 0 keeps
the plain names (`fleet`, `limit:fleet`), so one deployment looks as it always did.

A deployment that serves several models has a pool per model (`fleet/MODEL`, `fleet:1/MODEL`:
`scheduler.fleet.routing.Pool`), each with the fixed bound of its own, so one model's saturated
or failing pool never holds back another model's lines. Controlled, a model's pool takes the limit
published for it (`limit:fleet/MODEL`), else its deployment's.

The limit is whatever the capacity controller last published for that deployment (it lapses if
the controller stops), else the configured floor when telemetry is required, else the fixed
bound (`BACKFILL_MAX_INFLIGHT`, per deployment). The controller may also publish a shed target:
in-flight batch requests above it are aborted by their drains and requeued (batch requests are
idempotent). What batch requests observe (latency, tokens, 429/503) flows back to that
deployment's controller through shared counters.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from backfill.scheduler.fleet.routing import Pool
from backfill.storage.leases import (
    FLEET_POOL,
    RATE_KEY,
    LeaseStore,
    kv_key,
    obs_key,
    pool_name,
    released_limit,
    shed_key,
)

OVERLOAD_STATUS = frozenset({429, 503})


def pool_of(deployment: int | Pool, model: str | None = None) -> str:
    """The lease pool of a deployment (by its index in `BACKFILL_FLEET_URLS`), or of one model's
    pool on it (`storage.leases` names them)."""
    if isinstance(deployment, Pool):
        return pool_name(deployment.deployment, deployment.model)
    return pool_name(deployment, model)


@dataclass(frozen=True)
class KvBudget:
    """KV cache tokens the decoders leave to batch work, and the models whose lines in flight
    hold it (None: every model's): a model's own controller's budget is held by that model's
    lines only, on workers of its own."""

    tokens: int
    models: frozenset[str] | None


@dataclass(frozen=True)
class Observation:
    """What one batch request saw: fed to the capacity controller."""

    status_code: int
    latency_s: float
    transient: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0


# Cumulative counters, summed over every drain of every worker.
OBS_FIELDS = ("n", "overloaded", "failed", "latency_s", "prompt_tokens", "completion_tokens")


class ObservationLog:
    """Accumulates observations locally and adds them to shared counters now and then.

    With Redis the counters are a hash every process adds to, so the controller in the scheduler
    process sees what drains in worker processes saw. Without Redis (embedded mode) they stay in
    this process and the controller there relies on the fleet's telemetry alone."""

    def __init__(self, store: LeaseStore, *, key: str = obs_key(FLEET_POOL)) -> None:
        self._redis: Any = getattr(store, "r", None)
        self._key = f"{getattr(store, 'ns', 'backfill')}:{key}"
        self._lock = threading.Lock()
        self._pending = dict.fromkeys(OBS_FIELDS, 0.0)
        self._local = dict.fromkeys(OBS_FIELDS, 0.0)

    def record(self, obs: Observation) -> None:
        with self._lock:
            for bucket in (self._pending, self._local):
                bucket["n"] += 1
                bucket["overloaded"] += obs.status_code in OVERLOAD_STATUS
                bucket["failed"] += obs.transient and obs.status_code not in OVERLOAD_STATUS
                bucket["latency_s"] += obs.latency_s
                bucket["prompt_tokens"] += obs.prompt_tokens
                bucket["completion_tokens"] += obs.completion_tokens

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, dict.fromkeys(OBS_FIELDS, 0.0)
        if self._redis is None or not pending["n"]:
            return
        pipe = self._redis.pipeline(transaction=False)
        for name, value in pending.items():
            if value:
                pipe.hincrbyfloat(self._key, name, value)
        pipe.execute()

    def totals(self) -> dict[str, float]:
        """Cumulative counters: shared ones with Redis, this process's otherwise."""
        if self._redis is None:
            with self._lock:
                return dict(self._local)
        raw = self._redis.hgetall(self._key) or {}
        return {name: float(raw.get(name, 0.0)) for name in OBS_FIELDS}


class Admission:
    def __init__(
        self,
        leases: LeaseStore,
        *,
        fixed_limit: int,
        ttl_s: float,
        controlled: bool = False,
        floor: int = 0,
        observer: Callable[[Observation], None] | None = None,
        deployments: int = 1,
    ) -> None:
        self.leases = leases
        self.fixed_limit = fixed_limit
        self.ttl_s = ttl_s
        self.controlled = controlled
        self.floor = floor
        self.observer = observer
        self.deployments = max(1, deployments)
        self.logs = [ObservationLog(leases, key=obs_key(pool_of(d))) for d in range(self.deployments)]
        self.log = self.logs[0]
        # A model's pool on a deployment that serves several: what its lines observe steers that
        # model's controller (`scheduler.runtime.make_capacity_loop`), not the deployment's.
        self.pool_logs: dict[Pool, ObservationLog] = {}
        self._last_flush = 0.0
        self._turn = 0

    def limit(self, deployment: int | Pool = 0) -> int:
        model_pool = isinstance(deployment, Pool) and deployment.model is not None
        return released_limit(
            self.leases,
            pool_of(deployment),
            controlled=self.controlled,
            fixed_limit=self.fixed_limit,
            floor=self.floor,
            fallback_pool=pool_of(deployment.deployment) if isinstance(deployment, Pool) and model_pool else None,
        )

    def shed_target(self, deployment: int | Pool = 0) -> int | None:
        """In-flight batch requests the controller wants at most, right now (None: no shedding)."""
        if not self.controlled:
            return None
        published = self.leases.read(shed_key(pool_of(deployment)))
        return int(published) if published is not None and published.isdigit() else None

    def kv_budget_tokens(self) -> int | None:
        """KV cache tokens the fleet's decoders leave to batch work, summed over the deployments
        whose controller published one (None: none did, so the claims size nothing by KV)."""
        budget = self.kv_budget([Pool(d) for d in range(self.deployments)])
        return budget.tokens if budget is not None else None

    def kv_budget(
        self, pools: list[Pool], served: Callable[[int], frozenset[str] | None] | None = None
    ) -> KvBudget | None:
        """The KV budget of the lines of `pools` (a model's pools: `FleetRoutes.pools`): summed
        over them, a model's own pool's where its model's controller published one, else its
        deployment's (each deployment once). `served(d)`: the models deployment d serves, so the
        budget says whose lines in flight hold it (None: none published)."""
        if not self.controlled:
            return None
        tokens = 0
        published = False
        models: set[str] | None = set()
        counted: set[int] = set()
        for p in pools:
            own = self.leases.read(kv_key(pool_of(p))) if p.model is not None else None
            if own is not None and own.isdigit():
                tokens, published = tokens + int(own), True
                if models is not None:
                    models.add(str(p.model))
                continue
            if p.deployment in counted:
                continue
            counted.add(p.deployment)
            value = self.leases.read(kv_key(pool_of(p.deployment)))
            if value is None or not value.isdigit():
                continue
            tokens, published = tokens + int(value), True
            # The deployment's budget is shared by every model it serves (unknown: any model's lines).
            on_it = served(p.deployment) if served is not None else None
            models = None if models is None or on_it is None else models | on_it
        if not published:
            return None
        return KvBudget(tokens, frozenset(models) if models is not None else None)

    def batch_rate(self) -> float | None:
        """Batch tokens/s (prompt + output) across the fleet, as the controller last measured it;
        None when nothing is published or the lease store cannot be read (the planner then
        measures its own: a Redis restart must not end a drain with requests in flight)."""
        try:
            published = self.leases.read(RATE_KEY)
        except RedisError:
            return None
        try:
            return float(published) if published is not None else None
        except ValueError:
            return None

    async def acquire(
        self, n: int, *, wait_s: float, cancel: Callable[[], bool] | None = None, deployment: int = 0
    ) -> list[str]:
        """Up to n leases of one deployment; waits (polling) up to wait_s for at least one, or
        until `cancel()`."""

        async def only(_: int) -> dict[Pool, int]:
            return {Pool(deployment): n}

        return [lease for lease, _ in await self.acquire_spread(n, wait_s=wait_s, cancel=cancel, room=only)]

    async def acquire_spread(
        self,
        n: int,
        *,
        wait_s: float,
        cancel: Callable[[], bool] | None = None,
        room: Callable[[int], Awaitable[dict[Pool, int]]] | None = None,
    ) -> list[tuple[str, Pool]]:
        """Up to n leases spread over the pools: (lease id, pool) pairs. `room(n)` says how many
        each pool may take now (one whose circuit is open: none, or one probe; a model with no
        work: none); by default every deployment's plain pool may take all. Each round asks the
        pools in turn for an even share of what is still wanted, so the room one leaves goes to
        the next: a pool at its limit takes nothing and the others take its share. Waits
        (polling) up to wait_s for at least one lease, or until `cancel()`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        delay = 0.01
        while True:
            if cancel is not None and cancel():
                return []
            granted = await asyncio.to_thread(self._take_round, n, await room(n) if room else None)
            if granted or loop.time() >= deadline:
                return granted
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _take_round(self, n: int, room: dict[Pool, int] | None) -> list[tuple[str, Pool]]:
        pools = (
            [p for p, k in room.items() if k > 0] if room is not None else [Pool(d) for d in range(self.deployments)]
        )
        start, self._turn = self._turn, self._turn + 1
        order = [pools[(start + k) % len(pools)] for k in range(len(pools))]
        out: list[tuple[str, Pool]] = []
        for k, p in enumerate(order):
            want = math.ceil((n - len(out)) / (len(order) - k))
            if room is not None:
                want = min(want, room[p])
            if want <= 0:
                continue
            ids = self.leases.acquire(pool_of(p), limit=self.limit(p), n=want, ttl_s=self.ttl_s)
            out += [(lease, p) for lease in ids]
        return out

    async def release(self, lease_ids: list[str], deployment: int | Pool = 0) -> None:
        await asyncio.to_thread(self.leases.release, pool_of(deployment), lease_ids)

    def release_groups(self, by_pool: dict[Pool, list[str]]) -> None:
        """Give back leases of several pools in one call (`scheduler.capacity.admission`)."""
        for pool, lease_ids in by_pool.items():
            self.leases.release(pool_of(pool), lease_ids)

    def in_flight(self, deployment: int, models: frozenset[str] | None = None) -> int:
        """Leases held on a deployment: its plain pool and, given the models it serves, theirs."""
        return self.leases.count(pool_of(deployment)) + sum(
            self.leases.count(pool_of(deployment, m)) for m in sorted(models or ())
        )

    def observe(self, obs: Observation, deployment: int | Pool = 0) -> None:
        # The deployment's counters see every line (its controller, the fleet's rate); a model's
        # pool's see its own as well (that model's controller).
        d = deployment.deployment if isinstance(deployment, Pool) else deployment
        self.logs[d if d < self.deployments else 0].record(obs)
        if isinstance(deployment, Pool) and deployment.model is not None:
            pool_log = self.pool_logs.get(deployment)
            if pool_log is None:
                pool_log = self.pool_logs[deployment] = ObservationLog(self.leases, key=obs_key(pool_of(deployment)))
            pool_log.record(obs)
        if self.observer is not None:
            self.observer(obs)

    def totals(self) -> dict[str, float]:
        """The observation counters summed over every deployment."""
        out = dict.fromkeys(OBS_FIELDS, 0.0)
        for log in self.logs:  # (a model pool's counters are a part of its deployment's)
            for name, value in log.totals().items():
                out[name] += value
        return out

    def flush_observations(self, every_s: float = 0.25) -> None:
        now = time.monotonic()
        if now - self._last_flush >= every_s:
            self._last_flush = now
            for log in [*self.logs, *self.pool_logs.values()]:
                log.flush()


# Capacity leases given back in groups: one lease-store call for every lease freed meanwhile.
#
# A drain frees a lease each time a fleet call ends. Giving each back by itself costs a thread
# hop and a Redis round trip per line; instead `add` queues the lease and one pump gives back
# everything queued while its previous call was out. Nothing waits on purpose: when lines end
# one at a time each goes at once, and when many end together they go together, so the delay a
# lease sees is at most one lease-store round trip.
#
# Safety does not depend on the pump: a lease is only ever given back early (never kept past its
# line's end by more than that round trip), and one the pump could not give back (Redis away, the
# process killed) lapses by its TTL as before.


class LeaseReturns:
    def __init__(self, admission: Admission, on_store_down: Callable[[str], None]) -> None:
        self.admission = admission
        self.on_store_down = on_store_down
        self._queued: dict[Pool, list[str]] = {}  # pool -> lease ids to give back
        self._pump: asyncio.Task[None] | None = None

    def add(self, lease: str, pool: Pool) -> None:
        self._queued.setdefault(pool, []).append(lease)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())

    async def flush(self) -> None:
        """Give back everything queued now (the drain's end)."""
        if self._pump is not None:
            await self._pump
        await self._give_back_queued()

    async def _run(self) -> None:
        while self._queued:  # what was queued while the last call was out goes in the next
            await self._give_back_queued()

    async def _give_back_queued(self) -> None:
        if not self._queued:
            return
        queued, self._queued = self._queued, {}
        try:
            await asyncio.to_thread(self.admission.release_groups, queued)
        except RedisError:
            self.on_store_down("releasing leases; they lapse by themselves")
