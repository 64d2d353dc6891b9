"""The one admission point: every fleet request holds a capacity lease while in flight.

The limit is whatever the capacity controller last published (it lapses if the controller
stops), else the configured floor when telemetry is required, else the fixed bound. The
controller may also publish a shed target: in-flight batch requests above it are aborted by
their drains and requeued (batch requests are idempotent). What batch requests observe
(latency, tokens, 429/503) flows back to the controller through shared counters.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.leases import LeaseStore

POOL = "fleet"
LIMIT_KEY = "limit:fleet"
SHED_KEY = "shed:fleet"
RATE_KEY = "rate:fleet"  # batch tokens/s (prompt + output) the fleet currently gives batch work
OBS_KEY = "obs:fleet"
OVERLOAD_STATUS = frozenset({429, 503})


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

    def __init__(self, store: LeaseStore) -> None:
        self._redis: Any = getattr(store, "r", None)
        self._key = f"{getattr(store, 'ns', 'backfill')}:{OBS_KEY}"
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
    ) -> None:
        self.leases = leases
        self.fixed_limit = fixed_limit
        self.ttl_s = ttl_s
        self.controlled = controlled
        self.floor = floor
        self.observer = observer
        self.log = ObservationLog(leases)
        self._last_flush = 0.0

    def limit(self) -> int:
        if not self.controlled:
            return self.fixed_limit
        published = self.leases.read(LIMIT_KEY)
        # Fail closed: with no fresh word from the controller, only the floor is released.
        return int(published) if published is not None and published.isdigit() else self.floor

    def shed_target(self) -> int | None:
        """In-flight batch requests the controller wants at most, right now (None: no shedding)."""
        if not self.controlled:
            return None
        published = self.leases.read(SHED_KEY)
        return int(published) if published is not None and published.isdigit() else None

    def batch_rate(self) -> float | None:
        """Batch tokens/s (prompt + output) across the fleet, as the controller last measured it."""
        published = self.leases.read(RATE_KEY)
        try:
            return float(published) if published is not None else None
        except ValueError:
            return None

    async def acquire(self, n: int, *, wait_s: float, cancel: Callable[[], bool] | None = None) -> list[str]:
        """Up to n leases; waits (polling) up to wait_s for at least one, or until `cancel()`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        delay = 0.01
        while True:
            if cancel is not None and cancel():
                return []
            limit = await asyncio.to_thread(self.limit)
            granted = await asyncio.to_thread(self.leases.acquire, POOL, limit=limit, n=n, ttl_s=self.ttl_s)
            if granted or loop.time() >= deadline:
                return granted
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def release(self, lease_ids: list[str]) -> None:
        await asyncio.to_thread(self.leases.release, POOL, lease_ids)

    def observe(self, obs: Observation) -> None:
        self.log.record(obs)
        if self.observer is not None:
            self.observer(obs)

    def flush_observations(self, every_s: float = 0.25) -> None:
        now = time.monotonic()
        if now - self._last_flush >= every_s:
            self._last_flush = now
            self.log.flush()
