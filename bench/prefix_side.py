"""backfill's side of one prefix-benchmark run, in its own process: the real Dispatcher (leases
in Redis, lines claimed from Postgres, results committed there, a fixed lease limit) drains
one batch to the end and writes when it started and how many requests it sent.

Configured through the usual BACKFILL_* environment; bench/prefix.py sets it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import time
from typing import Any

import orjson
from sqlalchemy import func, select

from backfill.jobs.models import BatchRequest, RequestState
from backfill.scheduler.drain.dispatcher import Dispatcher
from backfill.scheduler.fleet.client import FleetClient
from backfill.scheduler.runtime import get_admission, make_planner
from backfill.storage.db import unit_of_work
from backfill.storage.leases import DRAIN_POOL, get_lease_store
from backfill.storage.objects import get_object_store
from backfill.storage.settings import get_settings


def unfinished(batch_id: str) -> int:
    with unit_of_work() as s:
        return int(
            s.execute(
                select(func.count()).where(
                    BatchRequest.batch_id == batch_id,
                    BatchRequest.state.in_([RequestState.pending, RequestState.running]),
                )
            ).scalar_one()
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kv-budget-tokens", type=int, default=0, help="0: no KV budget")
    p.add_argument("--expand-n", action="store_true")
    p.add_argument("--timeout-s", type=float, default=1200.0)
    a = p.parse_args(argv)
    claims = _count_claims()
    logging.basicConfig(level=logging.ERROR)
    s = get_settings()
    leases = get_lease_store()
    admission = get_admission()

    async def settle() -> None:
        """Wait out the lease store's settle time: the benchmark flushed its Redis database, which
        the store takes for a loss of its data (no leases for one lease TTL). Not batch time."""
        while not (slot := leases.acquire(DRAIN_POOL, limit=1, n=1, ttl_s=admission.ttl_s)):
            await asyncio.sleep(0.05)
        leases.release(DRAIN_POOL, slot)

    async def drain() -> tuple[float, int]:
        fleet = FleetClient(s.fleet_urls, timeout_s=s.fleet_timeout_s)
        sent = 0
        await settle()
        started = time.time()
        try:
            while unfinished(a.batch_id) and time.time() - started < a.timeout_s:
                d = Dispatcher(
                    store=get_object_store(),
                    leases=leases,
                    admission=admission,
                    fleet=fleet,
                    planner=make_planner(admission=admission),
                    max_attempts=s.max_attempts,
                    hint_mode=s.fleet_priority_hint,
                    kv_budget_tokens=a.kv_budget_tokens or None,
                    expand_n=a.expand_n,
                )
                done = await d.run(30.0, max_drains=1)
                sent += done
                if not done:
                    await asyncio.sleep(0.2)  # no drain slot yet (a previous run's lapsing), or all waiting
        finally:
            await fleet.aclose()
        return started, sent

    cpu_before = _cpu_s()
    started, sent = asyncio.run(drain())
    with open(a.out, "wb") as f:
        f.write(
            orjson.dumps(
                {"started": started, "ended": time.time(), "sent": sent, "cpu_s": _cpu_s() - cpu_before, **claims}
            )
        )


def _count_claims() -> dict[str, int]:
    """Counts the drain's claims and the lines they took (claims per line: what a claim's fixed
    cost is spread over)."""
    from backfill.scheduler.drain import claiming

    counts = {"claims": 0, "claimed": 0}
    claim = claiming.claim_requests  # type: ignore[attr-defined]

    def counted(*args: Any, **kw: Any) -> Any:
        got = claim(*args, **kw)
        counts["claims"] += 1
        counts["claimed"] += len(got)
        return got

    claiming.claim_requests = counted  # type: ignore[attr-defined]
    return counts


def _cpu_s() -> float:
    """This process's CPU (user and system): on the 2 shared cores, what the drain takes the
    simulated engines cannot have."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
