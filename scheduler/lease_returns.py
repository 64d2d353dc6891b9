"""Capacity leases given back in groups: one lease-store call for every lease freed meanwhile.

A drain frees a lease each time a fleet call ends. Giving each back by itself costs a thread
hop and a Redis round trip per line; instead `add` queues the lease and one pump gives back
everything queued while its previous call was out. Nothing waits on purpose: when lines end
one at a time each goes at once, and when many end together they go together, so the delay a
lease sees is at most one lease-store round trip.

Safety does not depend on the pump: a lease is only ever given back early (never kept past its
line's end by more than that round trip), and one the pump could not give back (Redis away, the
process killed) lapses by its TTL as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.exceptions import RedisError

from backfill.scheduler.admission import Admission


class LeaseReturns:
    def __init__(self, admission: Admission, on_store_down: Callable[[str], None]) -> None:
        self.admission = admission
        self.on_store_down = on_store_down
        self._queued: dict[int, list[str]] = {}  # deployment -> lease ids to give back
        self._pump: asyncio.Task[None] | None = None

    def add(self, lease: str, deployment: int) -> None:
        self._queued.setdefault(deployment, []).append(lease)
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
