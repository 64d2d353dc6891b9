"""Process-wide wiring of the scheduler's parts from settings."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import lru_cache
from typing import Protocol

from backfill.jobs.models import utcnow
from backfill.jobs.sweeps import PendingBatch, pending_batches
from backfill.jobs.teams import team_weights
from backfill.scheduler.admission import Admission
from backfill.scheduler.capacity import CapacityLoop, ControlConfig, Controller, FleetCapacityLoop, Slo
from backfill.scheduler.leases import LeaseStore, get_lease_store
from backfill.scheduler.policy import FairPlanner, PolicyConfig
from backfill.scheduler.telemetry import Endpoint, FleetTelemetry, KvModel, parse_endpoints
from backfill.storage.db import unit_of_work
from backfill.storage.settings import Settings, get_settings


@lru_cache
def get_admission() -> Admission:
    s = get_settings()
    return Admission(
        get_lease_store(),
        fixed_limit=s.max_inflight,
        ttl_s=s.lease_ttl_s,
        controlled=s.capacity_controlled,
        floor=s.capacity_floor,
        deployments=max(1, len(s.fleet_url_list)),
    )


def make_planner(refresh_s: float = 0.5, admission: Admission | None = None) -> Callable[[int], list[tuple[str, int]]]:
    """The dispatch policy over a briefly cached view of the batches with work left (their
    counters, their teams' weights, the fleet's batch throughput), so a release decision costs
    no scan of the pending lines."""
    admission = admission or get_admission()
    planner = FairPlanner(PolicyConfig(guaranteed_share=get_settings().deadline_guaranteed_share))
    cache: dict[str, tuple[float, list[PendingBatch], dict[str, float], float | None]] = {}
    local_rate = rate_meter(admission)

    def refresh() -> tuple[list[PendingBatch], dict[str, float], float | None]:
        with unit_of_work() as session:
            pending = pending_batches(session)
            weights = team_weights(session, team_ids={b.team_id for b in pending})
        return pending, weights, admission.batch_rate() or local_rate()

    def plan(slots: int) -> list[tuple[str, int]]:
        now = time.monotonic()
        if "v" not in cache or now - cache["v"][0] > refresh_s:
            cache["v"] = (now, *refresh())
        _, pending, weights, rate = cache["v"]
        return planner.plan(pending, slots, now=utcnow(), weights=weights, rate_tokens_s=rate)

    return plan


class _Totals(Protocol):
    def totals(self) -> dict[str, float]: ...


def rate_meter(log: _Totals, every_s: float = 0.5) -> Callable[[], float | None]:
    """Batch tokens/s from the observation counters (an `ObservationLog`, or an `Admission`'s sum
    over its deployments), for when no controller publishes a rate."""
    state: dict[str, float] = {}

    def rate() -> float | None:
        now = time.monotonic()
        totals = log.totals()
        tokens = totals["prompt_tokens"] + totals["completion_tokens"]
        if "t" not in state:
            state.update(t=now, tokens=tokens)
        elif now - state["t"] >= every_s:
            r = (tokens - state["tokens"]) / (now - state["t"])
            state["rate"] = r if "rate" not in state else 0.7 * state["rate"] + 0.3 * r
            state.update(t=now, tokens=tokens)
        return state.get("rate")

    return rate


def control_config(s: Settings) -> ControlConfig:
    return ControlConfig(
        slo=Slo(ttft_s=s.slo_ttft_s, itl_s=s.slo_itl_s),
        floor=s.capacity_floor,
        ceiling=s.capacity_ceiling or s.max_inflight,
        period_s=s.control_period_s,
        idle_target=s.capacity_idle_target,
        kv=KvModel(bytes_per_token=s.kv_bytes_per_token, budget_bytes=s.kv_budget_bytes),
        unseen_limit=s.max_inflight if s.capacity_control == "auto" else None,
    )


def deployment_telemetry(s: Settings) -> list[list[Endpoint]]:
    """Each deployment's metrics endpoints, in the order of `BACKFILL_FLEET_URLS` (deployment i's
    lease pool is `pool_of(i)`): `BACKFILL_FLEET_METRICS_URLS` lists them in that order (`;`
    between deployments), else each deployment's frontend `/metrics` is used."""
    if s.fleet_metrics_urls.strip():
        return parse_endpoints(s.fleet_metrics_urls)
    return [[Endpoint("frontend", url.removesuffix("/v1") + "/metrics")] for url in s.fleet_url_list]


def make_capacity_loop(
    settings: Settings | None = None, leases: LeaseStore | None = None
) -> CapacityLoop | FleetCapacityLoop:
    """A controller per deployment, each on its own telemetry and lease pool (one deployment: a
    plain `CapacityLoop`). `BACKFILL_CAPACITY_CEILING` / `BACKFILL_MAX_INFLIGHT` bound each."""
    s = settings or get_settings()
    deployments = deployment_telemetry(s)
    if not deployments:
        raise ValueError("capacity control needs fleet telemetry: set BACKFILL_FLEET_METRICS_URLS")
    urls = max(1, len(s.fleet_url_list))
    if len(deployments) != urls:
        raise ValueError(
            f"BACKFILL_FLEET_METRICS_URLS names {len(deployments)} deployments, BACKFILL_FLEET_URLS {urls}: "
            "give one `;`-separated group of metrics endpoints per fleet URL, in the same order"
        )
    store = leases or get_lease_store()
    loops = [
        CapacityLoop(Controller(control_config(s)), FleetTelemetry(eps), store, deployment=i)
        for i, eps in enumerate(deployments)
    ]
    return loops[0] if len(loops) == 1 else FleetCapacityLoop(loops)
