"""Process-wide wiring of the scheduler's parts from settings."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from backfill.jobs.models import utcnow
from backfill.jobs.retention import RetentionPolicy
from backfill.jobs.sweeps import PendingBatch, pending_batches
from backfill.jobs.teams import team_weights
from backfill.scheduler.capacity.admission import Admission
from backfill.scheduler.capacity.controller import CapacityLoop, FleetCapacityLoop
from backfill.scheduler.capacity.law import ControlConfig, Controller, Slo
from backfill.scheduler.capacity.telemetry import FleetTelemetry, KvModel
from backfill.scheduler.drain.dispatcher import Dispatcher
from backfill.scheduler.drain.escalation import (
    EscalatedRelease,
    Escalation,
    EscalationConfig,
    EscalationLimits,
    Escalator,
    escalated_plan,
)
from backfill.scheduler.drain.policy import FairPlanner, PolicyConfig
from backfill.scheduler.fleet.client import FleetClient
from backfill.scheduler.fleet.routing import FleetRoutes, Pool
from backfill.scheduler.leadership import AliveFile, FencedLeases, lead_while_leader, leader_lease
from backfill.scheduler.ticker import Ticker
from backfill.storage.broker import send_task
from backfill.storage.db import unit_of_work
from backfill.storage.fleet_models import get_catalog
from backfill.storage.leases import LeaseStore, get_lease_store
from backfill.storage.objects import ObjectStore, get_object_store
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
        deployments=max(1, len(s.fleet_urls)),
    )


@lru_cache
def drain_store() -> ObjectStore:
    """The object store a process's drains read their lines from, made once: an S3 client (and
    its bucket check, a request) cost each drain tens of milliseconds of CPU."""
    return get_object_store()


class Planner:
    """The dispatch policy over a briefly cached view of the batches with work left (their
    counters, their teams' weights, the fleet's batch throughput), so a release decision costs
    no scan of the pending lines. Calling it plans ordinary releases; `relaxed` and `overflow`
    plan the escalated ones (`scheduler.drain.escalation`) from the same view."""

    def __init__(self, admission: Admission, refresh_s: float = 0.5, escalator: Escalator | None = None) -> None:
        s = get_settings()
        self.admission = admission
        self.refresh_s = refresh_s
        self._policy = PolicyConfig(guaranteed_share=s.deadline_guaranteed_share)
        # Fair share across teams holds within each model: each model's lines fill that model's
        # pools, so each keeps its own virtual times (one model's backlog charges no team on another).
        self.fair: dict[str | None, FairPlanner] = {}
        self.escalator = escalator or get_escalator()
        self.escalations: dict[str, Escalation] = {}
        self._local_rate = rate_meter(admission)
        self._at: float | None = None
        self._view: tuple[list[PendingBatch], dict[str, float], float | None] = ([], {}, None)

    def _refresh(self) -> tuple[list[PendingBatch], dict[str, float], float | None]:
        now = time.monotonic()
        if self._at is None or now - self._at > self.refresh_s:
            with unit_of_work() as session:
                pending = pending_batches(session)
                weights = team_weights(session, team_ids={b.team_id for b in pending})
            rate = self.admission.batch_rate() or self._local_rate()
            self._at, self._view = now, (pending, weights, rate)
            self.escalations = self.escalator.decide(
                pending, now=utcnow(), clock_s=now, weights=weights, rate_tokens_s=rate
            )
        return self._view

    def __call__(self, slots: int, models: frozenset[str] | None = None) -> list[tuple[str, int]]:
        """Plan `slots` releases among the batches of `models` (None: every batch), on those
        models' own fair share."""
        pending, weights, rate = self._refresh()
        if models is not None:
            pending = [b for b in pending if b.model is None or b.model in models]
        key = next(iter(models)) if models is not None and len(models) == 1 else None
        fair = self.fair.setdefault(key, FairPlanner(self._policy))
        return fair.plan(pending, slots, now=utcnow(), weights=weights, rate_tokens_s=rate)

    def look_again(self) -> None:
        """The next call reads the batches afresh: the view gave nothing to claim, and a batch
        that has just finished validating should be released now, not a refresh later (an idle
        drain asks a few times, then ends)."""
        self._at = None

    def pending_models(self) -> set[str | None]:
        """The models of the batches with work left (None for a batch whose model is not recorded)."""
        pending, _, _ = self._refresh()
        return {b.model for b in pending if b.remaining > 0}

    def model_of(self, batch_id: str) -> str | None:
        return next((b.model for b in self._view[0] if b.batch_id == batch_id), None)

    def escalated(self) -> dict[str, Escalation]:
        self._refresh()
        return self.escalations

    def relaxed(self, slots: int) -> list[tuple[str, int]]:
        return escalated_plan(self.escalated(), slots, overflow=False)

    def overflow(self, slots: int) -> list[tuple[str, int]]:
        return escalated_plan(self.escalated(), slots, overflow=True)


@lru_cache
def get_escalator() -> Escalator:
    """One per process: a drain's planner lives for one slice (30 s), a batch's escalation watch
    for 5% of its window (3 min of 1 h), so the watch and the measured rate outlive the planner."""
    return Escalator(escalation_config(get_settings()))


def make_planner(refresh_s: float = 0.5, admission: Admission | None = None) -> Planner:
    return Planner(admission or get_admission(), refresh_s)


def escalation_config(s: Settings) -> EscalationConfig:
    return EscalationConfig(margin=s.escalation_margin, overflow_margin=s.overflow_margin)


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
        prefill_busy_target=s.capacity_prefill_busy_target,
        engine_priority=s.capacity_engine_priority,
        kv=KvModel(bytes_per_token=s.kv_bytes_per_token, budget_bytes=s.kv_budget_bytes),
        unseen_limit=s.max_inflight if s.capacity_control == "auto" else None,
    )


def make_capacity_loop(
    settings: Settings | None = None, leases: LeaseStore | None = None
) -> CapacityLoop | FleetCapacityLoop:
    """A controller per deployment, each on its own telemetry and lease pool (one deployment: a
    plain `CapacityLoop`). `BACKFILL_CAPACITY_CEILING` / `BACKFILL_MAX_INFLIGHT` bound each."""
    s = settings or get_settings()
    deployments = s.fleet_metrics
    if not deployments:
        raise ValueError("capacity control needs fleet telemetry: set BACKFILL_FLEET_METRICS_URLS")
    urls = max(1, len(s.fleet_urls))
    if len(deployments) != urls:
        raise ValueError(
            f"BACKFILL_FLEET_METRICS_URLS names {len(deployments)} deployments, BACKFILL_FLEET_URLS {urls}: "
            "give one `;`-separated group of metrics endpoints per fleet URL, in the same order"
        )
    store = leases or get_lease_store()
    loops = []
    for i, eps in enumerate(deployments):
        models = sorted({ep.model for ep in eps if ep.model})
        if len(models) < 2:
            loops.append(CapacityLoop(Controller(control_config(s)), FleetTelemetry(eps), store, deployment=i))
            continue
        # A deployment serving several models (its workers named `role@model=url`): a controller
        # per model's pool, on that model's workers and the frontend's series for that model, so
        # one model's interactive burst cuts only its own pool's limit.
        for m in models:
            own = [ep for ep in eps if ep.role == "frontend" or ep.model == m]
            telemetry = FleetTelemetry(own, model=m)
            loops.append(CapacityLoop(Controller(control_config(s)), telemetry, store, deployment=Pool(i, m)))
    return loops[0] if len(loops) == 1 else FleetCapacityLoop(loops)


def make_escalation(planner: Planner, leases: LeaseStore | None = None) -> EscalatedRelease:
    """A drain's escalated releases on `planner`'s view: the relaxed extra per fleet deployment,
    the overflow deployments after the fleet's (the `FleetClient` made with `overflow_urls`)."""
    s = get_settings()
    fleet_n = max(1, len(s.fleet_urls))
    limits = EscalationLimits(
        relaxed_extra=s.escalation_inflight,
        overflow_limit=s.overflow_max_inflight,
        overflow_deployments=list(range(fleet_n, fleet_n + len(s.overflow_urls))),
    )
    return EscalatedRelease(
        admission=planner.admission,
        leases=leases or get_lease_store(),
        limits=limits,
        escalated=planner.escalated,
        relaxed_plan=planner.relaxed,
        overflow_plan=planner.overflow,
        model_of=planner.model_of,
    )


def make_routes(s: Settings | None = None) -> FleetRoutes:
    """What each deployment serves (the fleet's, then the overflow ones, in the `FleetClient`'s
    order), from the process's model catalog."""
    s = s or get_settings()
    return FleetRoutes([*s.fleet_urls, *s.overflow_urls], get_catalog().served_by, refresh_s=min(5.0, s.models_cache_s))


async def run_drain(s: Settings, *, shutdown: threading.Event, on_all_recorded: Callable[[str], None]) -> int:
    """One drain, built from the settings: the fleet client over the deployments that serve each
    model, admission, the planner and escalation, then a time slice of releasing lines."""
    leases = get_lease_store()
    routes = make_routes(s)  # which deployments serve which model: a line goes only to those
    fleet = FleetClient(
        s.fleet_urls,
        timeout_s=s.fleet_timeout_s,
        api_key=s.fleet_api_key,
        redis_url=s.redis_url,
        overflow_urls=s.overflow_urls,
        overflow_api_key=s.overflow_api_key,
        routes=routes,
    )
    try:
        admission = get_admission()
        planner = make_planner()
        dispatcher = Dispatcher(
            store=drain_store(),
            leases=leases,
            admission=admission,
            # The KV the controller's model leaves to batch work: prefix groups and agent
            # sessions start only while what is in flight fits it (jobs.execution.claims); a
            # model's claims read its own pools' budget where its controller publishes one.
            kv_budget_tokens=await asyncio.to_thread(admission.kv_budget_tokens),
            kv_by_model=True,
            fleet=fleet,
            planner=planner,
            escalation=make_escalation(planner, leases),
            routes=routes,
            pending_models=planner.pending_models,
            max_attempts=s.max_attempts,
            hint_mode=s.fleet_priority_hint,
            shutdown=shutdown,
            grace_s=s.drain_grace_s,
            db_patience_s=s.db_outage_patience_s,
            on_all_recorded=on_all_recorded,
        )
        return await dispatcher.run(s.drain_slice_s, max_drains=s.drains)
    finally:
        await fleet.aclose()


def run_scheduler(s: Settings, *, stop: Callable[[], bool], alive_file: Path | None = None) -> None:
    """The scheduler process: lead while this replica holds the leader lease (the loop, and the
    capacity controller beside it), stand by otherwise, until `stop` says so."""
    lease = leader_lease(s)

    def lead(deposed: Callable[[], bool]) -> None:
        # A fresh ticker each term: what a previous term saw missing is stale now.
        ticker = Ticker(
            leases=get_lease_store(),
            enqueue=send_task,
            drains=s.drains,
            retention_policy=RetentionPolicy(
                orphan_grace_s=s.orphan_grace_s, result_body_grace_s=s.result_body_retention_s
            ),
            retention_interval_s=s.retention_interval_s,
        )
        # The capacity controller beside the ticker, publishing only while this replica leads: if
        # the process dies, the limit it published lapses and admission falls back to the floor.
        control_stop = threading.Event()
        control: threading.Thread | None = None
        if s.capacity_controlled:
            loop = make_capacity_loop(s, leases=FencedLeases(get_lease_store(), lease))
            control = threading.Thread(target=loop.run, args=(control_stop,), name="capacity", daemon=True)
            control.start()
        try:
            ticker.run_forever(s.tick_interval_s, stop=deposed)
        finally:
            # The next term starts only once this term's controller has stopped (its writes are
            # fenced to this term's token anyway).
            control_stop.set()
            if control is not None:
                control.join()

    lead_while_leader(
        lease,
        lead,
        stop=stop,
        progress_timeout_s=s.scheduler_progress_timeout_s,
        alive=AliveFile(alive_file) if alive_file else lambda: None,
    )
