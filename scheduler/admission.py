"""The one admission point: every fleet request holds a capacity lease while in flight.

The limit is whatever the capacity controller last published (it lapses if the controller
stops), else the configured floor when telemetry is required, else the fixed bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.leases import LeaseStore

POOL = "fleet"
LIMIT_KEY = "limit:fleet"


@dataclass(frozen=True)
class Observation:
    """What one batch request saw: fed to the capacity controller."""

    status_code: int
    latency_s: float
    transient: bool


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
    ) -> None:
        self.leases = leases
        self.fixed_limit = fixed_limit
        self.ttl_s = ttl_s
        self.controlled = controlled
        self.floor = floor
        self.observer = observer

    def limit(self) -> int:
        if not self.controlled:
            return self.fixed_limit
        published = self.leases.read(LIMIT_KEY)
        # Fail closed: with no fresh word from the controller, only the floor is released.
        return int(published) if published is not None and published.isdigit() else self.floor

    async def acquire(self, n: int, *, wait_s: float) -> list[str]:
        """Up to n leases; waits (polling) up to wait_s for at least one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        delay = 0.01
        while True:
            limit = await asyncio.to_thread(self.limit)
            granted = await asyncio.to_thread(self.leases.acquire, POOL, limit=limit, n=n, ttl_s=self.ttl_s)
            if granted or loop.time() >= deadline:
                return granted
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def renew(self, lease_ids: list[str]) -> None:
        await asyncio.to_thread(self.leases.renew, POOL, lease_ids, ttl_s=self.ttl_s)

    async def release(self, lease_ids: list[str]) -> None:
        await asyncio.to_thread(self.leases.release, POOL, lease_ids)

    def observe(self, obs: Observation) -> None:
        if self.observer is not None:
            self.observer(obs)
