"""backfill's side of a harvest run, in its own process: the real Dispatcher (leases in Redis,
lines claimed from Postgres, results committed there) with either a fixed lease limit (the static
sweep), the capacity controller publishing the limit from the fleet's telemetry, or (the oracle
run, `--limit-schedule`) a limit per window known in advance, published where the controller
publishes its own.

Configured through the usual BACKFILL_* environment; the harvest orchestrator sets it. Writes
what it did (completions, in-flight leases, the controller's decisions) as JSON and exits at
t_end without waiting for requests still in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
import time
from typing import Any

import orjson

from backfill.scheduler.capacity.admission import Observation, pool_of
from backfill.scheduler.capacity.controller import FleetCapacityLoop
from backfill.scheduler.capacity.law import Decision
from backfill.scheduler.drain.dispatcher import Dispatcher
from backfill.scheduler.fleet.client import FleetClient
from backfill.scheduler.runtime import get_admission, make_capacity_loop, make_planner, make_routes
from backfill.storage.leases import FLEET_POOL, LeaseStore, get_lease_store, limit_key, shed_key
from backfill.storage.objects import get_object_store
from backfill.storage.settings import get_settings
from bench.harvest_oracle import limit_at


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--t-start", type=float, required=True)
    p.add_argument("--t-end", type=float, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--limit-schedule", default="", help="oracle: JSON list of lease limits, one per window")
    p.add_argument("--t0", type=float, default=0.0, help="oracle: when the schedule's first window starts")
    p.add_argument("--window-s", type=float, default=1.0, help="oracle: the schedule's window")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # per-request notices would cost the fleet CPU time
    s = get_settings()
    leases = get_lease_store()
    admission = get_admission()
    done: list[tuple[float, int, int]] = []
    decisions: list[dict[str, Any]] = []
    samples: list[tuple[float, int, int]] = []

    def observed(obs: Observation) -> None:
        done.append((time.time(), obs.status_code, obs.completion_tokens))

    admission.observer = observed
    stop = threading.Event()
    if a.limit_schedule:
        schedule = [int(x) for x in orjson.loads(a.limit_schedule)]
        threading.Thread(
            target=_publish_schedule, args=(leases, schedule, a.t0, a.window_s, decisions, stop), daemon=True
        ).start()
    elif s.capacity_controlled:
        loop = make_capacity_loop(s, leases)

        def decided(t: float, d: Decision) -> None:
            decisions.append(
                {
                    "t": t,
                    "limit": d.limit,
                    "shed": d.shed_to,
                    "reason": d.reason,
                    "interactive": d.interactive,
                    "batch": d.batch,
                    "itl": d.itl_s,
                    "ttft": d.ttft_s,
                    "kv": d.kv_usage,
                    "cap": d.cap,
                    "idle": d.idle,
                }
            )

        # One controller per deployment behind a FleetCapacityLoop: every one's decisions count.
        for controlled in loop.loops if isinstance(loop, FleetCapacityLoop) else [loop]:
            controlled.on_decision = decided
        threading.Thread(target=loop.run, args=(stop,), daemon=True).start()

    async def dispatch() -> None:
        await asyncio.sleep(max(0.0, a.t_start - time.time()))
        # Routed by model, as a worker's drain is: on a fleet serving several models each model's
        # lines fill that model's own pool (a one-model fleet keeps its plain pool).
        routes = make_routes(s)
        fleet = FleetClient(s.fleet_urls, timeout_s=s.fleet_timeout_s, routes=routes)
        while time.time() < a.t_end:
            planner = make_planner(admission=admission)
            d = Dispatcher(
                store=get_object_store(),
                leases=leases,
                admission=admission,
                fleet=fleet,
                planner=planner,
                routes=routes,
                pending_models=planner.pending_models,
                max_attempts=s.max_attempts,
                hint_mode=s.fleet_priority_hint,
            )
            await d.run(a.t_end - time.time(), max_drains=1)

    async def sample() -> None:
        while time.time() < a.t_end:
            n = await asyncio.to_thread(leases.count, FLEET_POOL)
            samples.append((time.time(), n, await asyncio.to_thread(admission.limit)))
            await asyncio.sleep(0.25)

    async def both() -> None:
        task = asyncio.create_task(dispatch())
        await sample()
        stop.set()
        with open(a.out, "wb") as f:
            f.write(orjson.dumps({"done": done, "inflight": samples, "decisions": decisions}))
        os._exit(0)  # requests still in flight are simply dropped, as a killed worker's would be
        await task  # not reached

    asyncio.run(both())


def _publish_schedule(
    leases: LeaseStore,
    schedule: list[int],
    t0: float,
    window_s: float,
    decisions: list[dict[str, Any]],
    stop: threading.Event,
) -> None:
    """The oracle's limit, republished often (it lapses like the controller's would), and as the
    shed target too, as the controller publishes one when it cuts; a change is recorded as a
    decision so the plot shows it beside the controller's."""
    last = None
    while not stop.is_set():
        now = time.time()
        limit = limit_at(schedule, t0, now, window_s)
        leases.publish(limit_key(pool_of(0)), str(limit), ttl_s=2.0)
        leases.publish(shed_key(pool_of(0)), str(limit), ttl_s=2.0)  # a drop aborts the excess at once
        if limit != last:
            decisions.append({"t": now, "limit": limit, "shed": limit, "reason": "oracle"})
            last = limit
        stop.wait(0.1)


if __name__ == "__main__":
    main()
