"""A drain's fleet calls in flight, and shedding them when the capacity controller asks.

The controller publishes a shed target per deployment when it must give capacity back at once
(`scheduler.capacity.law`); every drain aborts its share of the excess, youngest first (they have
the least work to lose). An aborted call closes its connection, so the fleet drops the request
and frees its KV cache; its line goes back to pending without spending an attempt.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from backfill.scheduler.capacity.admission import Admission, pool_of
from backfill.scheduler.fleet.client import FleetReply
from backfill.scheduler.fleet.routing import Pool
from backfill.storage.leases import LeaseStore

log = logging.getLogger("backfill.dispatch")

FleetCall = asyncio.Task[FleetReply]


def shed_count(total: int, target: int, mine: int) -> int:
    """How many of this drain's in-flight requests to abort: its share of the excess."""
    if total <= target or mine <= 0 or total <= 0:
        return 0
    return min(mine, math.ceil((total - target) * mine / total))


class InflightCalls:
    """The fleet calls of one drain, each with its start time and the pool (a deployment, or one
    model's pool on it: `scheduler.fleet.routing.Pool`) whose capacity lease it holds."""

    def __init__(self, admission: Admission, leases: LeaseStore, lease_store_down: Callable[[str], None]) -> None:
        self.admission = admission
        self.leases = leases
        self._lease_store_down = lease_store_down
        self._calls: dict[FleetCall, tuple[float, int | Pool]] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call: FleetCall, deployment: int | Pool) -> None:
        self._calls[call] = (time.monotonic(), deployment)

    def discard(self, call: FleetCall) -> None:
        self._calls.pop(call, None)

    def abort_all(self) -> None:
        for call in list(self._calls):
            call.cancel()

    def started_on(self, deployment: int | Pool) -> dict[FleetCall, float]:
        """The calls holding `deployment`'s leases, with their start times."""
        return {c: t for c, (t, d) in self._calls.items() if d == deployment}

    def shed(self, mine: dict[FleetCall, float], total: int, target: int) -> int:
        """Abort this drain's share (of `mine`) of a deployment's `total` in flight above `target`,
        youngest first; returns how many."""
        k = shed_count(total, target, len(mine))
        for call in sorted(mine, key=mine.__getitem__, reverse=True)[:k]:
            self._calls.pop(call, None)  # counted once, even if the abort is slow
            call.cancel()
        return k

    async def watch(self, every_s: float = 0.1) -> None:
        """Shed what the controller's targets ask of this drain, every `every_s`, and pass the
        drain's observations on (one loop for both: each is a look at the lease store)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await asyncio.to_thread(self.admission.flush_observations)
                # Each pool this drain holds lines of: a model's pool has its own shed target.
                for deployment in {d for _, d in self._calls.values()}:
                    if isinstance(deployment, int) and (deployment < 0 or deployment >= self.admission.deployments):
                        continue  # escalated (unsheddable) or an overflow deployment's
                    if isinstance(deployment, Pool) and deployment.deployment >= self.admission.deployments:
                        continue
                    mine = self.started_on(deployment)
                    if not mine:
                        continue
                    target = await asyncio.to_thread(self.admission.shed_target, deployment)
                    if target is None:
                        continue
                    total = await asyncio.to_thread(self.leases.count, pool_of(deployment))
                    k = self.shed(mine, total, target)
                    if k:
                        log.info(
                            "shed %d in-flight requests (%s %d > target %d)", k, pool_of(deployment), total, target
                        )
            except RedisError:
                self._lease_store_down("shed check")
            except Exception:
                log.warning("shed check failed", exc_info=True)
