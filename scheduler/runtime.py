"""Process-wide wiring of the scheduler's parts from settings."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache

from jobs import execution
from jobs.execution import PendingBatch
from jobs.models import utcnow
from scheduler import policy
from scheduler.admission import Admission
from scheduler.leases import get_lease_store
from storage.db import unit_of_work
from storage.settings import get_settings


@lru_cache
def get_admission() -> Admission:
    s = get_settings()
    return Admission(
        get_lease_store(),
        fixed_limit=s.max_inflight,
        ttl_s=s.lease_ttl_s,
        controlled=s.capacity_control,
        floor=s.capacity_floor,
    )


def make_planner(refresh_s: float = 0.5) -> Callable[[int], list[tuple[str, int]]]:
    """The dispatch policy over a briefly cached view of the batches with work left, so a
    release decision costs no scan of the pending lines."""
    cache: dict[str, tuple[float, list[PendingBatch]]] = {}

    def planner(slots: int) -> list[tuple[str, int]]:
        now = time.monotonic()
        if "v" not in cache or now - cache["v"][0] > refresh_s:
            with unit_of_work() as session:
                cache["v"] = (now, execution.pending_batches(session))
        return policy.plan(cache["v"][1], slots, now=utcnow())

    return planner
